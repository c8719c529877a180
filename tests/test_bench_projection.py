"""The whole-model decode projection (kvfold/bench/projection.py, issue 42 item 4): its bytes per
token are decode_bytes' count split by format, the whole model's are the stack's layers summed by
kind over the release's layer list, and the time model is the formula its docstring states."""
import dataclasses

import pytest

from kvfold.bench import decode_bytes as D
from kvfold.bench import projection as P
from kvfold.bench import real_shapes as R
from kvfold.bench.configs import build_config, checkpoint_tensor_sizes
from kvfold.models.deepseek_v4.convert import write_official


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    cfg = build_config("tiny-bench")  # sliding, CSA, HCA; hash and scored MoE
    return cfg, write_official(tmp_path_factory.mktemp("v4") / "ckpt", cfg, R.random_tensors(cfg, seed=1))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from kvfold.bench.real_shapes_glm import glm_write
    from test_bench_real_shapes import _small_glm
    cfg = _small_glm()
    return cfg, glm_write(tmp_path_factory.mktemp("glm") / "ckpt", cfg, seed=1, max_shard_bytes=1 << 30)


@pytest.mark.parametrize("which", ["v4", "glm"])
def test_bytes_by_format_add_up_to_the_decode_bytes_count(which, request):
    cfg, d = request.getfixturevalue(which)
    per = P.token_bytes(cfg, P.tensor_headers(d))
    stack = P.whole_model_bytes(cfg, cfg, per)
    want = D.totals(D.decode_terms(cfg, checkpoint_tensor_sizes(d), 64))["weights_total"]
    assert sum(stack.values()) == pytest.approx(want, rel=1e-12)
    fmts = {f for f, b in stack.items() if b}
    assert fmts == ({"bf16", "fp8", "fp4", "f32"} if which == "v4" else {"bf16", "fp8", "f32"})


def test_a_longer_model_adds_each_layer_of_its_kind(v4):
    cfg, d = v4
    per = P.token_bytes(cfg, P.tensor_headers(d))
    # layer 1 (CSA, scored MoE) repeated twice more: exactly its bytes twice more
    longer = dataclasses.replace(cfg, num_hidden_layers=6, layer_types=cfg.layer_types + (cfg.layer_types[1],) * 2,
                                 compress_ratios=cfg.compress_ratios + (cfg.compress_ratios[1],) * 2,
                                 mlp_layer_types=cfg.mlp_layer_types + (cfg.mlp_layer_types[1],) * 2)
    base, more = P.whole_model_bytes(cfg, cfg, per), P.whole_model_bytes(longer, cfg, per)
    for f in base:
        assert more[f] == pytest.approx(base[f] + 2 * (per[1]["attn"][f] + per[1]["mlp"][f]))
    odd = dataclasses.replace(longer, compress_ratios=cfg.compress_ratios + (8, 8))
    with pytest.raises(ValueError, match="not in the measured stack"):
        P.whole_model_bytes(odd, cfg, per)


def test_each_format_streams_at_its_kernels_or_the_memorys_pace():
    rates = {"bf16": 10e9, "fp8": 5e9, "fp4": 4e9, "f32": 10e9}
    fmt = {"bf16": 2e9, "fp8": 1e9, "fp4": 0.0, "f32": 0.0}
    # 2 cores: bf16 at 20 GB/s, fp8 at 10; a 15 GB/s memory caps bf16 only
    assert P.streaming_seconds(fmt, rates, 2, 15e9) == pytest.approx(2 / 15 + 1 / 10)
    assert P.streaming_seconds(fmt, rates, 2, 1e12) == pytest.approx(2 / 20 + 1 / 10)
    run = {"threads": 2, "seconds": 2 / 15 + 1 / 10 + 4 * 0.003}
    assert P.fit_overhead(fmt, 4, run, rates, 15e9) == pytest.approx(0.003)
