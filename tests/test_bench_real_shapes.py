"""Real-shape bench checkpoints (kvfold/bench/real_shapes.py, issue 42 item 1): the release's
config cut to N layers, written tensor by tensor in the release's layout and formats, loaded as
stored. Checked here on the writer's own output for a small config (the real one is gigabytes)
and on the real config's shapes (no weights)."""
import json

import pytest
import torch

import kvfold
from kvfold.bench import real_shapes as R
from kvfold.bench.configs import build_config, checkpoint_tensor_sizes
from kvfold.models.deepseek_v4.config import CSA, HCA, SLIDING
from kvfold.models.deepseek_v4.convert import write_official
from kvfold.numerics.quant import E8M0_BIAS


def test_v4_flash_cut_to_four_layers_has_every_kind_at_release_widths():
    cfg = R.real_config("v4-flash")
    release = json.loads((R.Path(R.__file__).resolve().parents[1] / "assets/configs/deepseek_v4_flash.json").read_text())
    assert cfg.num_hidden_layers == 4 and cfg.num_nextn_predict_layers == 0
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    assert (cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.moe_intermediate_size) == \
        (release["dim"], release["vocab_size"], release["n_routed_experts"], release["moe_inter_dim"])
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_topk) == \
        (release["n_heads"], release["head_dim"], release["index_n_heads"], release["index_topk"])
    with pytest.raises(ValueError, match="--layers"):
        R.real_config("v4-flash", 0)


def test_the_written_checkpoint_is_the_release_format_and_loads_as_stored(tmp_path):
    cfg = build_config("tiny-bench")  # small widths, the same code path
    d = write_official(tmp_path / "ckpt", cfg, R.random_tensors(cfg, seed=3), max_shard_bytes=1 << 16)
    sizes = checkpoint_tensor_sizes(d)
    assert len(list(d.glob("model-*.safetensors"))) > 1  # sharded: the writer never held it whole
    from safetensors import safe_open
    dtypes = {}
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                dtypes[k] = fh.get_slice(k).get_dtype()
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3" and "layers.1.attn.wq_a.scale" in dtypes
    assert dtypes["layers.1.ffn.experts.0.w1.weight"] == "I8" and "layers.1.ffn.experts.0.w1.scale" in dtypes
    assert dtypes["embed.weight"] == "BF16" and dtypes["head.weight"] == "BF16"
    assert sizes["layers.1.ffn.experts.0.w2.weight"][0] == (cfg.hidden_size, cfg.moe_intermediate_size // 2)
    q = kvfold.load_model(d, weights="quantized")
    assert q.quantized_weights()
    st = q.new_state(capacity=64)
    logits = q.forward(list(range(2, 40)), st)
    assert torch.isfinite(logits).all() and logits.std() > 0
    # the same seed writes the same bytes; FP4 scales sit around 1/sqrt(fan in)
    again = write_official(tmp_path / "again", cfg, R.random_tensors(cfg, seed=3))
    assert checkpoint_tensor_sizes(again) == sizes
    from safetensors.torch import load_file
    a = {k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()}
    b = load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    exps = a["layers.1.ffn.experts.0.w1.scale"].view(torch.uint8).int() - E8M0_BIAS
    k = round(R.math.log2(1 / (R._E2M1_RMS * R.math.sqrt(cfg.hidden_size))))
    assert set(exps.unique().tolist()) <= {k - 1, k, k + 1}


def test_the_bench_refuses_a_real_shape_config_dequantized_before_any_work(tmp_path):
    from kvfold.bench.runner import build_parser, run_bench
    from kvfold.errors import ConfigError
    args = build_parser().parse_args(["--config", "v4-flash", "--layers", "2", "--cache-dir", str(tmp_path)])
    assert args.layers == 2
    with pytest.raises(ConfigError, match="--weights quantized"):
        run_bench(args)
    assert not any(tmp_path.iterdir())  # nothing written


def test_glm53_flash_cut_to_four_layers_has_both_attention_and_mlp_kinds_at_release_widths():
    cfg = R.real_config("glm53-flash")
    release = json.loads((R.Path(R.__file__).resolve().parents[1] / "assets/configs/glm5_3_flash.json").read_text())
    assert cfg.num_hidden_layers == 4
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",)
    for k in ("hidden_size", "vocab_size", "n_routed_experts", "moe_intermediate_size", "linear_num_heads",
              "index_n_heads", "index_topk", "index_kpool", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim"):
        assert getattr(cfg, k) == release[k], k
    with pytest.raises(ValueError, match="--layers"):
        R.real_config("glm53-flash", 46)
    from kvfold.models.glm5.config import glm5_config_from_dict
    d = cfg.to_hf_dict()  # what config.json holds: it reads back, and transformers finds its kv heads
    assert glm5_config_from_dict(d) == cfg and d["num_key_value_heads"] == cfg.num_attention_heads


def _small_glm():
    from kvfold.models.glm5.config import glm5_config_from_dict
    return glm5_config_from_dict(dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32,
        q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
        index_kpool=4, linear_head_dim=16, linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=5, pad_token_id=None))


def test_the_glm_checkpoint_is_block_fp8_where_the_release_is_and_loads_as_stored(tmp_path):
    from kvfold.bench.real_shapes_glm import FP8_BLOCK, glm_write
    from safetensors import safe_open
    cfg = _small_glm()  # small widths, GLM-5.3-Flash's layer schedule, the same code path
    d = glm_write(tmp_path / "ckpt", cfg, seed=5, max_shard_bytes=1 << 16)
    assert len(list(d.glob("model-*.safetensors"))) > 1  # sharded: the writer never held it whole
    dtypes = {}
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            dtypes.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})
    fp8 = {k for k, t in dtypes.items() if t == "F8_E4M3"}
    assert all(dtypes[k + "_scale_inv"] == "F32" for k in fp8)
    assert "model.layers.3.mlp.experts.2.up_proj.weight" in fp8 and "model.layers.3.self_attn.kv_b_proj.weight" in fp8
    assert "model.layers.3.self_attn.indexer.wk.weight" in fp8 and "model.layers.0.mlp.down_proj.weight" in fp8
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.3.self_attn.indexer.weights_proj.weight"):
        assert dtypes[k] == "BF16", k
    assert not any(".layers.0.self_attn." in k for k in fp8)  # KDA projections stay bf16
    assert json.loads((d / "config.json").read_text())["quantization_config"]["weight_block_size"] == list(FP8_BLOCK)
    q, deq = kvfold.load_model(d, weights="quantized"), kvfold.load_model(d)
    held = q.quantized_weights()
    assert held["model.layers.3.mlp.experts.gate_up_proj"].fmt == "fp8" and held["lm_head.weight"].fmt == "bf16"
    ids = list(range(2, 40))
    logits = q.forward(ids, q.new_state(capacity=64))
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(logits, deq.forward(ids, deq.new_state(capacity=64)))
    again = glm_write(tmp_path / "again", cfg, seed=5, max_shard_bytes=1 << 30)  # the same seed, the same bytes
    from safetensors.torch import load_file
    a = {k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()}
    b = load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_fp8_blocks_decode_to_the_weights_within_e4m3_rounding():
    from kvfold.bench.real_shapes_glm import E4M3_MAX, quantize_fp8_blocks
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    w[:128, :128] = 0  # an all-zero block gets scale 1, not a division by zero
    q, s = quantize_fp8_blocks(w, (128, 128))
    assert q.shape == w.shape and s.shape == (3, 2) and s[0, 0] == 1
    back = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 for normal values; values below
    # the smallest normal (2^-6 times the scale) are off by at most half its spacing, 2^-10 times it
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert ((back - w).abs() <= torch.maximum(w.abs() / 16, full * 2 ** -10)).all()
    assert (q.float().abs().amax() <= E4M3_MAX) and torch.isclose(q.float().abs().amax(), torch.tensor(E4M3_MAX))


def test_glm_decode_bytes_count_every_tensor_once_and_only_the_selected_experts(tmp_path):
    """decode_bytes' GLM-5.3 terms against an independent count over the written checkpoint: every
    tensor whole, except the embedding (one row), the routed experts (top-k of E) and the router
    (held in fp32); and the state at a context shorter and longer than the indexer's top-k."""
    from kvfold.bench import decode_bytes as D
    from kvfold.bench.real_shapes_glm import glm_write
    cfg = _small_glm()
    d = glm_write(tmp_path / "ckpt", cfg, seed=1, max_shard_bytes=1 << 30)
    sizes = checkpoint_tensor_sizes(d)
    want = 0.0
    for key, (shape, nbytes) in sizes.items():
        if key == "model.embed_tokens.weight":
            want += nbytes / shape[0]
        elif ".mlp.experts." in key:
            want += nbytes * cfg.num_experts_per_tok / cfg.n_routed_experts
        elif key.endswith(".mlp.gate.weight"):
            want += 4 * shape[0] * shape[1]
        else:
            want += nbytes
    for context in (5, 4 * cfg.index_topk):
        got = D.totals(D.decode_terms(cfg, sizes, context))
        assert got["weights_total"] == pytest.approx(want, rel=1e-12)
        kda = 3 * (cfg.linear_num_heads * cfg.linear_head_dim ** 2 + 3 * 3 * cfg.linear_num_heads * cfg.linear_head_dim)
        dsa = context * 2 * cfg.index_head_dim + min(cfg.index_topk, context) * cfg.kv_lora_rank
        assert got["state"] == 4 * (kda + dsa)
