"""GLM-5.3 (`glm5_next`) text model: parity with transformers' Glm5NextForConditionalGeneration (fp32),
chunking invariance, exact snapshot/restore and rewind, typed state errors, generate."""
import hashlib
import json

import pytest
import torch

import kvfold
from kvfold import errors
from kvfold.models.glm5.config import glm5_config_from_dict
from kvfold.models.glm5 import state as g5s
from kvfold.models.glm5.indexer_state import Glm5NextDsaState, dsa_blob_bytes
from helpers import TORCH_OPS, fp32_paths_bound, random_ids

LAYERS = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"]
INDEXERS = ["full", "full", "shared", "full", "full"]  # layer 2 reuses layer 1's selection
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_head_dim=8,
            index_n_heads=2, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=2,
            hc_sinkhorn_iters=5, pad_token_id=None, eos_token_id=None, layer_types=LAYERS, indexer_types=INDEXERS,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
              projection_intermediate_size=16)
LENGTHS = [1, 3, 4, 5, 63, 64, 65, 127, 128, 129]  # k-pool 4, KDA chunk 64


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("o_norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * r)
            elif name.endswith("_hc.scale"):
                p.copy_(1 + 0.3 * r)
            elif "conv1d" in name:
                p.copy_(0.4 * r)
            else:
                p.copy_(0.15 * r)
        for name, m in model.named_modules():
            if name.endswith("indexer"):
                # no exact top-k ties: keys positive (k_norm bias), index head 1 = -head 0, so every
                # pool has exactly one head with a positive q.K and a nonzero score
                m.k_norm.bias.fill_(3.0)
                m.k_norm.weight.mul_(0.3)
                d = m.head_dim
                m.wq_b.weight[d:] = -m.wq_b.weight[:d]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(TEXT), vision_config=VISION))
    hf.set_attn_implementation("eager")
    _randomize(hf)
    hf.eval()
    d = tmp_path_factory.mktemp("glm5")
    hf.save_pretrained(d)
    return hf, kvfold.load_model(d), d


@pytest.fixture(scope="module")
def seq():
    return random_ids(140, TEXT["vocab_size"], seed=5)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids[None], use_cache=False).logits[0].float()


def test_loads_text_model_and_notes_vision(pair, capsys):
    _, model, d = pair
    assert type(model).__name__ == "Glm5Model"
    assert model.config.indexer_types == tuple(INDEXERS)
    kvfold.load_model(d)
    assert "ignoring" in capsys.readouterr().err


@pytest.fixture(scope="module")
def hf_full(pair, seq):
    return hf_logits(pair[0], seq[:max(LENGTHS)])


@pytest.mark.parametrize("n", LENGTHS)
def test_full_sequence_matches_transformers(pair, seq, hf_full, n):
    _, model, _ = pair
    st = model.new_state(capacity=160)
    got = model.forward(seq[:n], st)
    want = hf_full[:n] if n > 5 else hf_logits(pair[0], seq[:n])
    # two fp32 evaluations of the same logits (kvfold and transformers): the paths bound of the next
    # test, 2.3e-5 to 3.1e-5 here; a wrong row, mask or KDA state is off by orders of magnitude more
    assert (got - want).abs().max().item() < fp32_paths_bound(want, model.config.num_hidden_layers)


def test_chunked_and_token_by_token_equal_full(pair, seq):
    """Chunked prefill and token-by-token decode give the logits of one full prefill up to fp32
    rounding, with a bound derived from the magnitudes involved.

    Each fp32 path differs from the exact logits by its own rounding error, so
    |path - full| <= |path - exact| + |full - exact|. To first order a stack of L blocks adds one
    local rounding term per block, carried (and amplified) by the blocks after it: the error grows
    linearly in L and is proportional to the logits' scale (scaling lm_head by 0.1 or 10 leaves it
    unchanged in units of eps * max|logit|). So |path - exact| <= c * L * eps * max|logit|,
    eps = 2^-23. Measured against a float64 oracle (transformers' model in float64, its KDA
    kernels' fp32 casts lifted) over 96 sequences at this depth and 16 at each of depths 2, 10
    and 20, these four paths, native kernels on and off: c has median 1.6, 99th percentile 5.1
    and maximum 7.1, flat in L from 2 to 20 (linear growth, not sqrt(L)); c = 8. (Two of those
    runs flipped a DSA top-k pick between near-tied pools, a discrete jump that is no rounding
    error; this sequence has none.) The bound is 2 * 8 * L * eps * max|logit| (3.1e-5 here: L = 5,
    max|logit| 3.27). This sequence reaches 3.2e-6 (10x below), the worst of the 96 sequences
    33 eps * max|logit| (2.4x below); with decays formed as exp(G_t - G_s) (see kda.py) two of
    them passed the bound (up to 250 eps * max|logit|). A KDA state off by a relative 1e-3 moves
    these logits by 2e-4, a lost state by 0.3 or more."""
    _, model, _ = pair
    n = 131
    full = model.forward(seq[:n], model.new_state(capacity=n))
    bound = fp32_paths_bound(full, model.config.num_hidden_layers)  # helpers.py: the same formula
    for chunks in ([64, 1, 66], [3, 61, 2, 65], [1] * 70 + [61]):
        st = model.new_state(capacity=n, max_rewind=3)
        outs, p = [], 0
        for c in chunks:
            outs.append(model.forward(seq[p:p + c], st))
            p += c
        assert (torch.cat(outs) - full).abs().max().item() < bound


def test_kda_chunked_form_is_as_accurate_as_the_recurrence():
    """Both fp32 forms of the KDA recurrence against the recurrence in float64: random unit keys,
    log-decays lb * sigmoid(N(0, 1)) with lb = -5 as in the model (mean -2.5, so a 64-token chunk's
    cumulative log-decay G reaches about -160), a nonzero start state, 4 chunks of 64.

    Bound: 12 u * max|exact| on outputs and final state, u = 2^-24. The longest accumulations are
    a chunk's 64-term sums (its triangular solve, B @ u), whose rounding grows like sqrt(64) u = 8 u
    in the random-walk model; 12 u allows 1.5x that. No step of the chunked form is worse
    conditioned than the recurrence once every decay is a product of the per-step factors exp(g_j)
    (kda.py). Measured: the recurrence 2.0 u here (2.1 u at worst over ten such draws), the
    chunked form 2.9 u (3.8 u). Decays formed as exp(G_t - G_s) from G = cumsum(g) carried the
    rounding of G_t itself (~u |G_t|) into every decay: 50 u here, 19 to 91 u over the draws."""
    from kvfold.models.glm5.kda import kda_chunked, kda_recurrent, l2norm
    gen = torch.Generator().manual_seed(0)
    t, h, d = 256, 2, 8
    q = l2norm(TORCH_OPS, torch.randn(t, h, d, generator=gen)) * d ** -0.5
    k = l2norm(TORCH_OPS, torch.randn(t, h, d, generator=gen))
    v = torch.randn(t, h, d, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(t, h, d, generator=gen))
    beta = torch.sigmoid(torch.randn(t, h, generator=gen))
    s0 = 0.5 * torch.randn(h, d, d, generator=gen)
    o64, s64, _ = kda_recurrent(*(x.double() for x in (q, k, v, g, beta, s0)))
    u = 2.0 ** -24
    for form in (kda_recurrent, kda_chunked):
        o, s, _ = form(q, k, v, g, beta, s0)
        assert (o.double() - o64).abs().max().item() <= 12 * u * o64.abs().max().item()
        assert (s.double() - s64).abs().max().item() <= 12 * u * s64.abs().max().item()


def continue_after(model, st, ids, start, chunks=(3, 1, 1, 5)):
    outs, p = [], start
    for c in chunks:
        outs.append(model.forward(ids[p:p + c], st))
        p += c
    return torch.cat(outs)


@pytest.mark.parametrize("pos", [0, 1, 4, 7, 63, 64, 66, 129])
def test_snapshot_restore_continues_bit_identically(pair, seq, pos):
    _, model, _ = pair
    a = model.new_state(capacity=150, max_rewind=2)
    if pos:
        model.forward(seq[:pos], a)
    blob = a.snapshot()
    want = continue_after(model, a, seq, pos)
    # another capacity, the same max_rewind: a state's last max_rewind tokens of each call run one
    # per KDA chunk (kda.py), so the continuation's bits are those of states of one max_rewind
    b = model.new_state(capacity=145, max_rewind=2)
    model.forward(seq[:9], b)  # overwrite some rows first
    b.restore(blob)
    assert b.pos == pos
    assert torch.equal(continue_after(model, b, seq, pos), want)


def _buffers(st):
    out = []
    for ls in st.layers:
        if isinstance(ls, g5s.KdaLayerState):
            out += [ls.conv.clone(), ls.rec.clone()]
        else:
            out.append(ls.latent.clone())
            if ls.dsa is not None:
                out += [t.clone() for t in (ls.dsa.k_normed, ls.dsa.gate, ls.dsa.valid)] + [ls.dsa.len]
    return out + [st.pos]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


def _source_and_target(pair, seq):
    """(model, a state at 45 tokens, its snapshot, another state at 10 tokens, that one's buffers)."""
    _, model, _ = pair
    src = model.new_state(capacity=100)
    model.forward(seq[:45], src)
    tgt = model.new_state(capacity=100)
    model.forward(seq[:10], tgt)
    return model, src, src.snapshot(), tgt, _buffers(tgt)


def test_bad_snapshots_are_refused_in_order_and_change_nothing(pair, seq):
    model, src, blob, tgt, before = _source_and_target(pair, seq)
    hdr = g5s.blob.HEADER.size
    flipped = bytearray(blob)
    flipped[len(blob) - 100] ^= 1
    cases = [(blob[:20], errors.SnapshotTruncatedError), (blob[:hdr + 10], errors.SnapshotTruncatedError),
             (b"XXXXXXXX" + blob[8:], errors.SnapshotMagicError),
             (blob[:8] + (1).to_bytes(4, "little") + blob[12:], errors.SnapshotVersionError),  # the old layout
             (blob[:8] + (3).to_bytes(4, "little") + blob[12:], errors.SnapshotVersionError),
             (blob[:16] + b"0" * 16 + blob[32:], errors.SnapshotModelError),
             (blob[:32] + (2).to_bytes(4, "little") + blob[36:], errors.SnapshotDtypeError),
             (blob[:40] + (46).to_bytes(8, "little") + blob[48:], errors.SnapshotCountsError),
             (blob[:-40] + blob[-32:], errors.SnapshotSizeError), (blob + b"\0", errors.SnapshotSizeError),
             (bytes(flipped), errors.SnapshotChecksumError),
             (b"XXXXXXXX" + blob[8:-1] + bytes([blob[-1] ^ 1]), errors.SnapshotMagicError)]
    for bad, err in cases:
        with pytest.raises(err):
            tgt.restore(bad)
        assert _same(_buffers(tgt), before)
    small = model.new_state(capacity=40)
    with pytest.raises(errors.SnapshotCapacityError):
        small.restore(blob)
    assert small.pos == 0
    with pytest.raises(errors.SnapshotMagicError):  # a DeepSeek-V4 blob is not a GLM-5 blob
        tgt.restore(kvfold.load_model("tiny-random").new_state(capacity=8).snapshot())
    assert _same(_buffers(tgt), before)


def _table(blob):
    """[(section, offset of its bytes)] read from a snapshot's own section table."""
    hdr, rec = g5s.blob.HEADER, g5s.blob.SECTION
    n = hdr.unpack_from(blob)[5]
    off, out = hdr.size + n * rec.size, []
    for i in range(n):
        s = g5s.Section(*rec.unpack_from(blob, hdr.size + i * rec.size))
        out.append((s, off))
        off += s.nbytes
    return out


def _resigned(blob):
    return blob[:-32] + hashlib.sha256(blob[:-32]).digest()


def test_snapshot_dsa_part_is_the_layer_blob(pair, seq):
    _, model, _ = pair
    st = model.new_state(capacity=100)
    model.forward(seq[:45], st)
    blob = st.snapshot()
    full = [i for i, ls in enumerate(st.layers) if isinstance(ls, g5s.MlaLayerState) and ls.dsa is not None]
    parts = [(s, off) for s, off in _table(blob) if s.kind == g5s.DSA_BLOB]
    assert full and [s.layer for s, _ in parts] == full  # one DSA section per full DSA layer, nothing else
    for s, off in parts:
        dsa = st.layers[s.layer].dsa
        raw = blob[off:off + s.nbytes]
        assert raw == dsa.snapshot_blob()  # byte for byte the layer's own blob
        assert len(raw) == dsa_blob_bytes(45, dsa.index_head_dim, dsa.dtype)  # rows in use, not capacity
        other = Glm5NextDsaState(64, dsa.index_head_dim, 4, dtype=dsa.dtype)
        other.restore_blob(raw)  # and it decodes through restore_blob
        assert other.len == 45 and all(torch.equal(a, b) for a, b in zip(other.reachable(), dsa.reachable()))
    big = model.new_state(capacity=150)  # the snapshot does not depend on capacity
    model.forward(seq[:45], big)
    assert big.snapshot() == blob
    # nor on max_rewind where the forward computed the same bits (the rewind rings are not in it):
    # one token per call is one token per KDA chunk at any max_rewind
    plain, ring = model.new_state(capacity=100), model.new_state(capacity=100, max_rewind=3)
    for p in range(12):
        for s_ in (plain, ring):
            model.forward(seq[p:p + 1], s_)
    assert ring.snapshot() == plain.snapshot()


def test_corrupted_dsa_part_is_refused_with_the_blob_error_and_changes_nothing(pair, seq):
    model, src, blob, tgt, before = _source_and_target(pair, seq)
    parts = [(s, off) for s, off in _table(blob) if s.kind == g5s.DSA_BLOB]
    d = src.layers[parts[0][0].layer].dsa.index_head_dim
    for s, off in (parts[0], parts[-1]):  # the last layer too: earlier layers must not be restored first
        def patch(at, data):
            return blob[:off + at] + data + blob[off + at + len(data):]
        cases = [(_resigned(patch(8, (d + 1).to_bytes(8, "little"))), errors.SnapshotModelError,
                  "index_head_dim"),  # other width
                 (_resigned(patch(0, (44).to_bytes(8, "little"))), errors.SnapshotSizeError,
                  "implies"),  # header len off by one
                 (patch(20, bytes([blob[off + 20] ^ 1])), errors.SnapshotChecksumError, "checksum")]  # not re-signed
        for bad, err, msg in cases:
            with pytest.raises(err, match=msg) as e:
                tgt.restore(bad)
            assert type(e.value) is err
            assert _same(_buffers(tgt), before)
    tgt.restore(blob)  # the intact blob still restores into the same state
    assert tgt.pos == 45 and _same(_buffers(tgt), _buffers(src))


@pytest.mark.parametrize("pos", [3, 4, 5, 62, 63, 64, 66])
@pytest.mark.parametrize("rejected", [0, 1, 3, 4])
def test_rejected_drafts_rewind_exactly(pair, seq, pos, rejected):
    _, model, _ = pair
    ref = model.new_state(capacity=100, max_rewind=4)  # the same chunking of each call (kda.py)
    model.forward(seq[:pos], ref)
    want = continue_after(model, ref, seq, pos, chunks=(4, 1, 1))
    st = model.new_state(capacity=100, max_rewind=4)
    model.forward(seq[:pos], st)
    drafts = random_ids(rejected, TEXT["vocab_size"], seed=pos + 7)
    if rejected:
        model.forward(drafts[:1], st)  # one token, then a verify chunk
        if rejected > 1:
            model.forward(drafts[1:], st)
    st.rewind_to(pos)
    assert torch.equal(continue_after(model, st, seq, pos, chunks=(4, 1, 1)), want)


def test_rewind_inside_a_verify_chunk(pair, seq):
    _, model, _ = pair
    ref = model.new_state(capacity=100, max_rewind=4)
    model.forward(seq[:62], ref)
    model.forward(seq[62:64], ref)
    want = model.forward(seq[64:67], ref)
    st = model.new_state(capacity=100, max_rewind=4)
    model.forward(seq[:62], st)
    model.forward(torch.cat([seq[62:64], random_ids(3, 96, seed=1)]), st)  # verify: 2 accepted, 3 rejected
    st.rewind_to(64)
    # both ran the KDA recurrence one token per chunk there, but the rows feeding the deeper layers
    # came from a 5-row call in one and a 2-row call in the other: two fp32 paths to the same logits
    bound = fp32_paths_bound(want, model.config.num_hidden_layers)
    assert (model.forward(seq[64:67], st) - want).abs().max().item() < bound


def test_rewind_refusals(pair, seq):
    _, model, _ = pair
    st = model.new_state(capacity=100, max_rewind=3)
    model.forward(seq[:20], st)
    with pytest.raises(kvfold.RewindError, match="only shrinks"):
        st.rewind_to(21)
    with pytest.raises(kvfold.RewindError, match="max_rewind=3"):
        st.rewind_to(16)
    assert st.pos == 20
    st.rewind_to(18)
    with pytest.raises(kvfold.RewindError):  # ring positions are counted from the last write
        st.rewind_to(16)
    assert st.pos == 18


def test_state_errors_are_typed_and_change_nothing(pair, seq, tiny):
    _, model, _ = pair
    st = model.new_state(capacity=12)
    model.forward(seq[:10], st)
    before = _buffers(st)
    with pytest.raises(kvfold.CapacityError):
        model.forward(seq[:3], st)
    assert _same(_buffers(st), before)
    with pytest.raises(kvfold.StateMismatchError):
        model.forward(seq[:1], tiny.new_state(capacity=8))
    with pytest.raises(kvfold.StateMismatchError):
        tiny.forward(seq[:1], st)
    assert _same(_buffers(st), before)
    a, b = model.new_state(capacity=8), model.new_state(capacity=8)
    assert a.kv_id != b.kv_id
    a.free()
    a.free()
    assert a.nbytes == 0
    with pytest.raises(kvfold.FreedStateError):
        model.forward(seq[:1], a)
    with pytest.raises(kvfold.FreedStateError):
        a.snapshot()


def test_generate_plain_and_ngram_equal_greedy(pair, seq):
    _, model, _ = pair
    prompt = seq[:20].tolist() + seq[:12].tolist()  # a repeat gives the n-gram drafter something
    st = model.new_state(capacity=60)
    logits = model.forward(prompt, st)
    want = []
    for _ in range(16):
        want.append(int(torch.argmax(logits[-1])))
        logits = model.forward(want[-1:], st)
    plain = kvfold.generate(model, prompt, 16, stop_ids=[])
    spec = kvfold.generate(model, prompt, 16, stop_ids=[], speculative="ngram", num_draft=3)
    assert plain.tokens == want
    assert spec.tokens == want
    assert spec.drafted > 0


def test_accounting_and_real_config_bytes(pair):
    _, model, _ = pair
    st = model.new_state(capacity=64, max_rewind=2)
    assert st.nbytes == pytest.approx(64 * model.state_bytes_per_token() + model.fixed_state_bytes(2), abs=64)
    assert model.num_parameters() > 0
    # GLM-5.3-Flash (index_kpool 4 from its config.json), bf16
    from kvfold.models.glm5.model import Glm5Model
    cfg = glm5_config_from_dict({"model_type": "glm5_next_text", "index_kpool": 4})
    assert len(cfg.dsa_layers) == 11 and len(cfg.kda_layers) == 34
    meta = Glm5Model.__new__(Glm5Model)
    meta.config, meta.dtype = cfg, torch.bfloat16
    # per token: 11 latent rows of 512 bf16, 11 indexer rows of 513 B, and a quarter of 11 pooled
    # keys (one bf16 key row of 128 and a validity byte per pool of 4)
    assert meta.state_bytes_per_token() == 11 * 512 * 2 + 11 * 513 + 11 * (128 * 2 + 1) / 4 == 17613.75
    assert meta.fixed_state_bytes(0) == 34 * (64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2)


def test_config_parsing_and_validation():
    base = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
            "text_config": dict(TEXT, model_type="glm5_next_text"), "vision_config": VISION}
    cfg = glm5_config_from_dict(base)
    assert cfg.layer_types == tuple(LAYERS) and cfg.hc_mult == 2
    d = glm5_config_from_dict({"model_type": "glm5_next_text", "num_hidden_layers": 8,
                               "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention"
                                               for i in range(8)], "index_topk_pattern": "FFFFFFSF"})
    assert d.layer_types[3] == "indexed_attention" and d.indexer_types[6] == "shared"
    assert glm5_config_from_dict({"model_type": "glm5_next_text"}).indexer_types == ("full",) * 45
    for bad in ({"qk_rope_head_dim": 64}, {"index_topk": 10, "index_kpool": 4}, {"index_kpool": 0},
                {"q_lora_rank": None}, {"num_hidden_layers": 4, "indexer_types": ["full", "full", "full", "shared"],
                                        "layer_types": ["linear_attention"] * 3 + ["indexed_attention"]}):
        with pytest.raises(kvfold.ConfigError):
            glm5_config_from_dict({"model_type": "glm5_next_text", **bad})
    lac = glm5_config_from_dict({"model_type": "glm5_next_text", "linear_attn_config": {
        "head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 3, "gate_lower_bound": None}})
    assert (lac.linear_head_dim, lac.linear_num_heads, lac.linear_conv_kernel_dim, lac.linear_lower_bound) == \
        (64, 8, 3, -5.0)
    json.dumps(base)


def test_text_only_in_memory_layout_loads_identically(pair, seq, tmp_path):
    """A text-only checkpoint (`model.*`, model_type glm5_next_text) in the in-memory layout
    (attn_hc.fn, fused conv1d, forget_gate.*, stacked experts) plus a second MTP layer to ignore
    (kvfold reads layer num_hidden_layers only: tests/test_glm5_mtp.py)."""
    from safetensors.torch import save_file
    hf, model, d = pair
    sd = {"model." + k: v.contiguous() for k, v in hf.model.language_model.state_dict().items()}
    sd["lm_head.weight"] = hf.lm_head.weight.detach().contiguous()
    sd["model.layers.6.eh_proj.weight"] = torch.zeros(2, 2)  # an MTP layer past the one read
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(TEXT, model_type="glm5_next_text",
                                                          architectures=["Glm5NextTextModel"])))
    other = kvfold.load_model(tmp_path)
    a = model.forward(seq[:40], model.new_state(capacity=40))
    assert torch.equal(other.forward(seq[:40], other.new_state(capacity=40)), a)
    del sd["model.norm.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(kvfold.CheckpointError, match="lacks"):
        kvfold.load_model(tmp_path)


def test_shared_selection_is_carried_across_kda_layers(tmp_path, seq):
    """kvfold runs a 'shared' DSA layer after KDA layers (HF only hands a selection to the next
    layer): same results for any chunking, and only full layers own an indexer state."""
    from kvfold.models.glm5.model import Glm5Model
    cfg = glm5_config_from_dict(dict(TEXT, model_type="glm5_next_text", num_hidden_layers=4,
                                     layer_types=LAYERS[:2] + ["linear_attention", "indexed_attention"],
                                     indexer_types=["full", "full", "full", "shared"],
                                     mlp_layer_types=["dense"] * 4))
    m = Glm5Model(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    st = m.new_state(capacity=70)
    assert st.layers[1].dsa is not None and st.layers[3].dsa is None
    full = m.forward(seq[:70], st)
    st2 = m.new_state(capacity=70)
    parts = torch.cat([m.forward(seq[a:b], st2) for a, b in ((0, 5), (5, 6), (6, 70))])
    assert (parts - full).abs().max().item() < fp32_paths_bound(full, cfg.num_hidden_layers)  # two fp32 paths


def test_engine_matches_plain_greedy(pair, seq):
    from helpers import chunked_reference
    _, model, _ = pair
    ids = seq.tolist()
    prompts = [ids[:130], ids[:7], ids[:130] + ids[:5]]  # the third hits the prefix cache at 128
    eng = kvfold.Engine(model, max_seq_len=300)
    assert eng.state_bytes(130) == model.new_state(capacity=130).nbytes
    outs = eng.generate(prompts[:2], kvfold.SamplingParams(max_tokens=6))
    outs += eng.generate(prompts[2:], kvfold.SamplingParams(max_tokens=6))  # restores a snapshot at 128
    for p, o in zip(prompts, outs):
        assert o.token_ids == chunked_reference(model, p, 6, stop_ids=[])
    assert outs[2].cached_tokens == 128
    # the MLA latent rows live in the shared pool (tests/test_glm5_pages.py), the prefix hit's by reference
    assert eng.pages is not None and eng.metrics()["pages_total"] == eng.pages.num_pages > 0


def test_server_serves_glm5_with_greedy_equal_to_generate(pair, seq):
    """`kvfold serve` on a GLM-5.3 checkpoint: a token-id completion over HTTP (real openai client)
    equals kvfold.generate."""
    import openai
    from kvfold.server.app import create_app
    from helpers import serving

    _, model, _ = pair
    prompt = [int(t) for t in seq[:40]]
    want = kvfold.generate(model, prompt, 8, stop_ids=[]).tokens
    engine = kvfold.Engine(model, max_seq_len=256, max_running=4, max_queue=8)
    with serving(create_app(engine, model_name="glm5", api_key="k")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        r = c.completions.create(model="glm5", prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        got = r.choices[0].token_ids
    assert got == want  # ignore_eos (vLLM's extension): no early stop, as generate was told
    assert engine.metrics()["live_states"] == 0


@pytest.mark.batch_invariance
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_forward_batch_is_one_call_bit_identical_to_each_sequence_alone(pair, seq, kv_dtype):
    _, model, _ = pair
    model.set_batch_invariant(True)
    try:
        prompts, feeds = [seq[:0], seq[:7], seq[:70]], [seq[100:105], seq[105:106], seq[106:107]]

        def prefilled(p):
            st = model.new_state(capacity=160, max_rewind=2, kv_dtype=kv_dtype)
            if len(p):
                model.forward(p, st)
            return st
        alone, batched = [prefilled(p) for p in prompts], [prefilled(p) for p in prompts]
        want = [model.forward(f, st) for f, st in zip(feeds, alone)]
        got = model.forward_batch(list(zip(feeds, batched)), last_only=False)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        for step in range(4):
            tok = [[int(seq[120 + step + i])] for i in range(3)]
            got = model.forward_batch(list(zip(tok, batched)))
            assert all(torch.equal(g, model.forward(t, st, last_only=True)) for g, t, st in zip(got, tok, alone))
        assert all(a.snapshot() == b.snapshot() for a, b in zip(alone, batched))
    finally:
        model.set_batch_invariant(False)
