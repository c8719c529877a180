"""Hold the HF oracle (tests/hf_oracle.py) to what kvfold's parity tests rely on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

import hf_oracle as O
from helpers import fp32_paths_bound

ORACLE_SEEDS = O.ORACLE_SEEDS  # build seeds; input ids use the same seed
SPEC_LENGTHS = (1, 3, 4, 5, 127, 128, 129, 255, 256, 257)
# Gap at the top-k cut, relative to the row's largest |score|, that must separate the k-th and
# (k+1)-th index scores, so that fp32 noise in kvfold (~1e-7, plus ~1e-6 carried from upstream
# layers) cannot flip the selected set.
MIN_TOPK_MARGIN = 5e-5


@pytest.fixture(scope="module")
def models():
    return {seed: O.build_hf_model(seed=seed) for seed in ORACLE_SEEDS}


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def test_tiny_config_fields():
    cfg = O.tiny_hf_config()
    assert cfg.layer_types == O.TINY_LAYER_TYPES
    assert cfg.mlp_layer_types == O.TINY_MLP_LAYER_TYPES
    assert cfg.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert cfg.qk_rope_head_dim == 8 and cfg.head_dim == 32
    assert cfg._attn_implementation == "eager"
    assert cfg.tie_word_embeddings is False
    rp = cfg.rope_parameters
    assert rp["main"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert rp["compress"]["rope_type"] == "yarn"
    assert rp["compress"]["rope_theta"] == 160000.0
    assert rp["compress"]["attention_factor"] == 1.0
    # overrides reach any field
    small = O.tiny_hf_config(num_hidden_layers=2, layer_types=O.TINY_LAYER_TYPES[:2],
                             mlp_layer_types=["hash_moe", "moe"], index_topk=2)
    assert small.num_hidden_layers == 2 and small.index_topk == 2
    assert O.tiny_hf_config().rope_parameters == rp  # no aliasing between calls


def _yarn_reference(theta, dim, factor, orig, beta_fast, beta_slow):
    """DeepSeek-V4 YaRN, written independently of HF."""
    f = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    low = math.floor(dim * math.log(orig / (2 * math.pi * beta_fast)) / (2 * math.log(theta)))
    high = math.ceil(dim * math.log(orig / (2 * math.pi * beta_slow)) / (2 * math.log(theta)))
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return f * (1 - ramp) + f / factor * ramp, ramp


def test_yarn_is_active_with_unit_attention_factor(models):
    rot = models[0].model.rotary_emb
    assert rot.compress_attention_scaling == 1.0 and rot.main_attention_scaling == 1.0
    plain_10k = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    plain_160k = 1.0 / 160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(rot.main_inv_freq, plain_10k, rtol=1e-6, atol=0)
    assert not torch.allclose(rot.compress_inv_freq, plain_160k, rtol=1e-3, atol=0)
    expected, ramp = _yarn_reference(160000.0, 8, 16.0, 256, 32, 1)
    assert ramp.tolist() == [0.0, 0.5, 1.0, 1.0]  # one extrapolated, one blended, two interpolated
    torch.testing.assert_close(rot.compress_inv_freq.double(), expected, rtol=1e-6, atol=0)
    # the compressors / indexers own separate rotary modules; they must agree
    for name, mod in models[0].named_modules():
        if isinstance(mod, O.hf_dsv4.DeepseekV4RotaryEmbedding):
            assert torch.equal(mod.compress_inv_freq, rot.compress_inv_freq), name


def test_legacy_rope_scaling_kwarg_is_equivalent():
    a = O.tiny_hf_config()
    b = O.tiny_hf_config(rope_parameters=None, rope_scaling=dict(O.TINY_YARN))
    assert a.rope_parameters == b.rope_parameters


# ------------------------------------------------------------------------------------------------
# Random model
# ------------------------------------------------------------------------------------------------


def test_build_is_deterministic_and_seeded(models):
    again = O.build_hf_model(seed=0)
    sd0, sd0b, sd1 = models[0].state_dict(), again.state_dict(), models[ORACLE_SEEDS[1]].state_dict()
    assert sd0.keys() == sd0b.keys()
    assert all(torch.equal(sd0[k], sd0b[k]) for k in sd0)
    assert all(not torch.equal(sd0[k], sd1[k]) for k in sd0)


def test_every_tensor_is_random(models):
    m = models[0]
    cfg = m.config
    assert not m.training
    sd = m.state_dict()
    assert len(sd) == 149
    for name, t in sd.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64 and t.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
            assert int(t.min()) >= 0 and int(t.max()) < cfg.n_routed_experts
            assert all(len(set(row)) == len(row) for row in t.tolist()), "ids within a row must differ"
            assert len(set(map(tuple, t.tolist()))) > 40  # of 56 ordered pairs
            assert (t[:, 0] == t[:, 1]).sum() == 0
            continue
        assert t.dtype == torch.float32, name
        assert t.numel() < 2 or t.std() > 0.01, f"{name} looks constant"
        assert not torch.all(t == 0), name
        if t.numel() > 1:
            assert not torch.all(t == 1), name
    # the tensors HF zero/one-initialises really are random here
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.self_attn.compressor.position_bias",
                 "model.layers.1.self_attn.compressor.indexer.position_bias",
                 "model.layers.2.self_attn.compressor.position_bias", "model.layers.0.attn_hc.base",
                 "model.layers.0.ffn_hc.scale", "model.hc_head.hc_base", "model.hc_head.hc_scale",
                 "model.layers.2.mlp.gate.e_score_correction_bias"):
        assert sd[name].abs().min() > 0 and not torch.all(sd[name] == 1), name
    # norms ~ 1, projections ~ 1/sqrt(fan_in)
    w = sd["model.layers.1.self_attn.q_b_proj.weight"]
    assert abs(w.std().item() * math.sqrt(w.shape[1]) - 1) < 0.1
    assert abs(sd["model.norm.weight"].mean().item() - 1) < 0.05


@pytest.mark.parametrize("seed", ORACLE_SEEDS)
def test_activations_are_order_one(models, seed):
    logits = O.hf_logits(models[seed], O.random_input_ids(257, seed=seed))
    assert logits.shape == (257, 300) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0 and logits.abs().max().item() < 20


# ------------------------------------------------------------------------------------------------
# Indexer top-k ties
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ORACLE_SEEDS)
def test_no_topk_ties_at_spec_lengths(models, seed):
    m = models[seed]
    for length in SPEC_LENGTHS:
        ids = O.random_input_ids(length, seed=seed)
        assert not O.hf_indexer_has_ties(m, ids), f"exact top-k tie: seed={seed} length={length}"
        margin = O.hf_indexer_topk_margin(m, ids)
        assert margin > MIN_TOPK_MARGIN, f"near tie {margin:.2e}: seed={seed} length={length}"
        # lengths >= 20 have rows with more visible entries than k=4, so the check is not vacuous
        assert math.isfinite(margin) == (length >= 20)


def test_no_exact_ties_or_zero_scores_for_any_seed():
    """Exact ties came from ReLU zeros (all indexer heads q.k <= 0 -> score exactly 0); the paired
    +/- indexer heads rule those out for every seed, not just the chosen ones."""
    for seed in range(12):
        m = O.build_hf_model(seed=seed)
        ids = O.random_input_ids(257, seed=seed)
        for name, s in O.hf_indexer_scores(m, ids).items():
            assert not (s == 0).any(), f"seed={seed} {name}: exact zero index score"
        assert not O.hf_indexer_has_ties(m, ids), f"seed={seed}"


def test_indexer_scores_are_distinct(models):
    scores = O.hf_indexer_scores(models[0], O.random_input_ids(257, seed=0))
    assert sorted(scores) == ["model.layers.1.self_attn.compressor.indexer.scorer",
                              "model.layers.3.self_attn.compressor.indexer.scorer"]
    for name, s in scores.items():
        assert s.shape == (257, 64)
        vis = s[torch.isfinite(s)]
        assert vis.numel() == sum((p + 1) // 4 for p in range(257))
        assert (vis > 0).float().mean() > 0.4, f"{name}: scores mostly negative"
        for p in range(s.shape[0]):  # within a query row every visible score differs
            row = s[p][torch.isfinite(s[p])]
            assert row.unique().numel() == row.numel(), f"{name} row {p}"


def test_hf_topk_matches_scores(models):
    """HF's selected sets equal the top-k of the visible scores we expose (no ties at the cut)."""
    ids = O.random_input_ids(257, seed=0)
    scores = O.hf_indexer_scores(models[0], ids)
    topk = O.hf_indexer_topk(models[0], ids)
    assert sorted(topk) == ["model.layers.1.self_attn.compressor.indexer",
                            "model.layers.3.self_attn.compressor.indexer"]
    for name, sel in topk.items():
        s = scores[name + ".scorer"]
        assert sel.shape == (257, 4)
        for p in range(257):
            n_vis = (p + 1) // 4
            row = sel[p]
            valid = row[row >= 0]
            assert valid.numel() == min(4, n_vis) and (row[valid.numel():] == -1).all()
            if n_vis > 4:
                expect = s[p].topk(4).indices.sort().values
                assert torch.equal(valid, expect), f"{name} row {p}"
            else:
                assert valid.tolist() == list(range(n_vis))


def test_tie_detector_detects_forced_ties():
    m = O.build_hf_model(seed=0)
    ids = O.random_input_ids(64, seed=0)
    assert not O.hf_indexer_has_ties(m, ids)
    with torch.no_grad():  # zero indexer head weights -> every score is exactly 0
        m.model.layers[3].self_attn.compressor.indexer.scorer.weights_proj.weight.zero_()
    assert O.hf_indexer_has_ties(m, ids)
    assert O.hf_indexer_topk_margin(m, ids) == 0.0
    assert not O.hf_indexer_has_ties(m, ids[:19])  # <= 4 visible entries per row: no cut, no tie


# ------------------------------------------------------------------------------------------------
# Causality of HF's no-cache path
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ORACLE_SEEDS)
def test_oracle_is_causal(models, seed):
    m = models[seed]
    for length, prefixes in ((257, (1, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 127, 128, 129, 200, 256)),
                             (40, (1, 2, 7, 8, 12, 16, 19, 20, 21, 39))):
        ids = O.random_input_ids(length, seed=seed)
        full = O.hf_logits(m, ids)
        for t in prefixes:  # a prefix and the whole sequence: two fp32 paths to the same logits
            bound = fp32_paths_bound(full[:t], m.config.num_hidden_layers)
            torch.testing.assert_close(O.hf_logits(m, ids[:t]), full[:t], rtol=0, atol=bound,
                                       msg=lambda s: f"seed={seed} L={length} t={t}: {s}")


# ------------------------------------------------------------------------------------------------
# Checkpoint round trip
# ------------------------------------------------------------------------------------------------


def _expected_keys(model, key_format):
    """The names each key_format stores, derived from the module state dict."""
    sd = model.state_dict()
    if key_format == "module":
        return set(sd)
    official = {o for k in sd for o in O.official_keys(k, model.config.n_routed_experts)}
    if key_format == "official":
        return official
    return {O.save_pretrained_key(o) for o in official}


def _check_roundtrip(model, directory, ids, ref):
    # the raw from_pretrained result: nothing missing, unexpected, re-initialised or cast
    raw, info = DeepseekV4ForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    sd, sd_raw = model.state_dict(), raw.state_dict()
    assert sd.keys() == sd_raw.keys()
    for k in sd:
        assert sd_raw[k].dtype == sd[k].dtype and torch.equal(sd_raw[k], sd[k]), f"{k} changed on reload"
    # unaligned safetensors memory may move raw logits by float noise only (other GEMM kernels:
    # two fp32 paths to the same logits)
    torch.testing.assert_close(O.hf_logits(raw.eval(), ids), ref, rtol=0,
                               atol=fp32_paths_bound(ref, model.config.num_hidden_layers))
    # load_hf_checkpoint (fresh memory) reproduces the oracle bit for bit
    assert torch.equal(O.hf_logits(O.load_hf_checkpoint(directory), ids), ref)


@pytest.mark.parametrize("key_format", O.KEY_FORMATS)
@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_roundtrip(models, tmp_path, key_format, sharded):
    m = models[0]
    ids = O.random_input_ids(129, seed=0)
    ref = O.hf_logits(m, ids)
    d = O.save_hf_checkpoint(m, tmp_path / "ckpt", max_shard_size="40KB" if sharded else None,
                             key_format=key_format)
    names = sorted(p.name for p in d.iterdir())
    if sharded:
        assert "model.safetensors.index.json" in names
        shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
        assert len(shards) > 1 and "model.safetensors" not in names
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
    else:
        assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    stored = O.checkpoint_tensors(d)
    if sharded:
        assert set(index["weight_map"]) == set(stored)
    assert set(stored) == _expected_keys(m, key_format)
    if key_format == "official":
        assert not any(k.startswith("model.") for k in stored)
        assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn"} <= set(stored)
        assert "layers.0.ffn.gate.tid2eid" in stored and "layers.2.ffn.gate.bias" in stored
    if key_format != "module":  # per-expert split: w1 = gate rows, w3 = up rows of gate_up_proj
        gate_up = m.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
        prefix = "" if key_format == "official" else "model."
        torch.testing.assert_close(stored[f"{prefix}layers.2.ffn.experts.5.w1.weight"], gate_up[5, :32], rtol=0, atol=0)
        torch.testing.assert_close(stored[f"{prefix}layers.2.ffn.experts.5.w3.weight"], gate_up[5, 32:], rtol=0, atol=0)
    tid = [v for k, v in stored.items() if k.endswith("tid2eid")]
    assert len(tid) == 2 and all(t.dtype == torch.int64 for t in tid)
    assert sum(k.endswith("e_score_correction_bias") or k.endswith("gate.bias") for k in stored) == 3
    assert all(v.dtype == torch.float32 for k, v in stored.items() if not k.endswith("tid2eid"))
    _check_roundtrip(m, d, ids, ref)


def test_plain_from_pretrained_uses_grouped_mm_experts(models, tmp_path):
    """Without experts_implementation="eager", from_pretrained picks grouped_mm: same weights,
    logits equal only to float noise. load_hf_checkpoint pins eager."""
    m = models[0]
    ids = O.random_input_ids(129, seed=0)
    ref = O.hf_logits(m, ids)
    d = O.save_hf_checkpoint(m, tmp_path / "ckpt")
    plain = DeepseekV4ForCausalLM.from_pretrained(str(d)).eval()
    assert plain.config._attn_implementation == "eager"
    assert plain.config._experts_implementation == "grouped_mm"
    torch.testing.assert_close(O.hf_logits(plain, ids), ref, rtol=0,
                               atol=fp32_paths_bound(ref, m.config.num_hidden_layers))  # two fp32 paths
    pinned = O.load_hf_checkpoint(d)
    assert pinned.config._experts_implementation == "eager"
    assert torch.equal(O.hf_logits(pinned, ids), ref)
