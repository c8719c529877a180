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
