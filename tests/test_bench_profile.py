"""`python -m kvfold.bench.profile`: the per-decode-step breakdown on the micro `tiny-bench` config."""
from __future__ import annotations

import pytest

import kvfold
from kvfold.bench import profile as P
from kvfold.numerics.backend import KernelSet
from kvfold.bench.configs import ensure_checkpoint
from kvfold.models.deepseek_v4.attention import Attention
from kvfold.layers.basic import Norm


@pytest.mark.parametrize("native_on", [True, False])
def test_profile_breakdown_has_every_category_and_adds_up(tmp_path, native_on):
    model = kvfold.load_model(str(ensure_checkpoint("tiny-bench", tmp_path / "cache", 0)))
    before = (Attention._attend, Attention.forward, Norm.forward, model.lm_head.forward)
    model.set_kernels(KernelSet(native=native_on))
    model.set_batch_invariant(native_on)  # the mode rests on the native kernels
    res = P.profile_decode(model, context=24, steps=2, warmup=1)
    cats = res["categories"]
    assert set(cats) == set(P.CATEGORIES) | {P.OTHER}
    assert all(v >= 0 for v in cats.values())
    # every piece of a decode step ran (tiny-bench has SLIDING, CSA and HCA layers and MoE on all);
    # with the native kernels a decode row's folds and top-k run inside attention core's one call,
    # and the compressors' and indexer's projections inside the attention's fused projections
    fused = {"compressors", "indexer select"} if native_on else set()
    for c in P.CATEGORIES:
        if c in fused:
            assert cats[c] == 0 and res["calls"][c] == 0, c
        else:
            assert cats[c] > 0 and res["calls"][c] > 0, c
    assert sum(v for c, v in cats.items() if c != P.OTHER) <= res["instrumented_wall_ms"] + 1e-9
    assert sum(cats.values()) <= res["instrumented_wall_ms"] * (1 + 1e-9)
    assert res["wall_ms"] > 0
    assert res["aten_top_level_ops"] > 0 and res["aten_ops"] >= res["aten_top_level_ops"]
    assert abs(sum(res["aten_by_category"].values()) - res["aten_top_level_ops"]) < 1e-6
    text = P.format_profile(res)
    for c in (*P.CATEGORIES, P.OTHER, "aten ops per token"):
        assert c in text
    # the wrappers were the tool's only: the library's methods are restored
    assert (Attention._attend, Attention.forward, Norm.forward) == before[:3]
    assert "forward" not in vars(model.lm_head)


def test_profile_cli_prints_the_table(tmp_path, capsys):
    rc = P.main(["--config", "tiny-bench", "--context", "12", "--steps", "2", "--warmup", "1", "--threads", "1",
                 "--cache-dir", str(tmp_path / "cache"), "--no-aten"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "attention core" in out and "other" in out and "ms/token" in out


def test_probes_are_forward_hooks_and_model_scopes_and_leave_nothing_behind(tmp_path):
    from kvfold import profiling
    model = kvfold.load_model(str(ensure_checkpoint("tiny-bench", tmp_path / "cache", 0)))
    methods = ("_attend", "project", "fold", "queries", "select")
    timer = P._Timer()
    with P.probes(model, timer):
        hooked = [m for m in model.modules() if m._forward_pre_hooks]
        assert all(len(m._forward_pre_hooks) == len(m._forward_hooks) == 1 for m in hooked)
        kinds = {type(m).__name__ for m in hooked}
        assert {"Block", "Attention", "MoE", "Norm", "HyperHead", "Linear"} <= kinds
        assert [m for m in hooked if type(m).__name__ == "Linear"] == [model.lm_head]  # not every Linear
        assert model.model.embed_tokens in hooked
        assert profiling._listener is timer  # the model's own scopes report to this run's timer
        assert not any(n in vars(m) for m in model.modules() for n in methods)  # nothing patched
    assert profiling._listener is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert not any(n in vars(m) for m in model.modules() for n in methods)
