"""`kvfold bench` harness: end to end on the micro `tiny-bench` config (fresh subprocess cells,
both engines), time-limit handling, the copy-bandwidth probe and the summary arithmetic."""
from __future__ import annotations

import argparse
import json

import pytest

from kvfold.bench import configs as C
from kvfold.bench import report
from kvfold.bench import runner as R



def _args(tmp_path, *extra: str) -> argparse.Namespace:
    ns = R.build_parser().parse_args(["--config", "tiny-bench", "--decode-tokens", "4", "--threads", "1",
                                      "--warmup", "4", "--cache-dir", str(tmp_path / "cache"),
                                      "--out", str(tmp_path / "out.json"), *extra])
    ns.command_line = "pytest"
    return ns


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    args = _args(tmp, "--contexts", "16,40", "--vs", "transformers", "--time-limit", "120")
    rc = R.run_bench(args, log=None)
    return rc, json.loads((tmp / "out.json").read_text()), tmp


def test_end_to_end_both_engines(e2e):
    rc, res, _ = e2e
    assert rc == 0
    assert res["settings"]["engines"] == ["kvfold", "transformers"]
    cells = res["cells"]
    # alternation: kvfold then transformers, per context
    assert [(c["context"], c["engine"]) for c in cells] == [
        (16, "kvfold"), (16, "transformers"), (40, "kvfold"), (40, "transformers")]
    for c in cells:
        assert c["status"] == "ok", c
        for k in ("prefill_tok_s", "decode_tok_s", "prefill_peak_rss_bytes", "rss_after_load_bytes", "load_s"):
            assert c[k] > 0, (k, c)
        assert c["prefill_peak_rss_bytes"] >= c["rss_before_prefill_bytes"] > 0
        assert c["decode_tokens"] == 4 and len(c["tokens"]) == 5
    by = {(c["context"], c["engine"]): c for c in cells}
    for row in res["rows"]:
        kv, hf = by[(row["context"], "kvfold")], by[(row["context"], "transformers")]
        assert row["prefill_ratio"] == pytest.approx(kv["prefill_tok_s"] / hf["prefill_tok_s"])
        assert row["decode_ratio"] == pytest.approx(kv["decode_tok_s"] / hf["decode_tok_s"])
        # same checkpoint, same prompt, exact engines: the greedy continuations match
        assert row["greedy_tokens_agree"] == row["greedy_tokens_compared"] == 5
    for eng in ("kvfold", "transformers"):
        fl = res["flatness"][eng]
        assert (fl["short_context"], fl["long_context"]) == (16, 40)
        assert fl["flatness"] == pytest.approx(by[(40, eng)]["decode_tok_s"] / by[(16, eng)]["decode_tok_s"])


def test_end_to_end_sanity_and_report(e2e):
    _, res, _ = e2e
    san = res["sanity"]
    assert san["status"] == "ok" and san["passed"]
    assert (san["missing"], san["unexpected"], san["mismatched"]) == (0, 0, 0)
    assert san["max_abs_diff_prefill"] < 1e-3 and san["max_abs_diff_decode"] < 1e-3
    rep = res["report"]
    assert "kvfold prefill tok/s" in rep and "hf decode tok/s" in rep and "decode flatness kvfold" in rep
    assert res["machine"]["cpu_count"] >= 1 and res["machine"]["torch"]
    assert res["command"] == "pytest"


def test_bfloat16_run_reports_its_drift_from_float32(tmp_path):
    rc = R.run_bench(_args(tmp_path, "--contexts", "16", "--vs", "transformers", "--dtype", "bfloat16",
                           "--time-limit", "120"), log=None)
    res = json.loads((tmp_path / "out.json").read_text())
    san = res["sanity"]
    assert rc == 0 and san["passed"] and san["dtype"] == "bfloat16"
    # bf16 really ran: its logits drift from fp32 by far more than fp32 rounding; reported, not judged
    assert san["tolerance"] is None and 1e-3 < san["max_abs_diff_prefill"] < san["logits_scale"]
    assert res["settings"]["kvfold_dtype"] == "bfloat16" and "kvfold bfloat16" in res["report"]
    assert "drift of a lower precision" in res["report"]
    assert all(c["status"] == "ok" for c in res["cells"])


def test_checkpoint_is_reused(e2e):
    _, res, tmp = e2e
    before = (tmp / "cache" / "bench-tiny-bench" / "model.safetensors").stat().st_mtime_ns
    again = C.ensure_checkpoint("tiny-bench", tmp / "cache", 0)
    assert str(again) == res["checkpoint"]
    assert (again / "model.safetensors").stat().st_mtime_ns == before


def test_time_limit_reports_skip_and_stops_that_engine(tmp_path):
    # 0.3 s cannot even import torch: the cell is killed and reported, longer contexts are not run
    rc = R.run_bench(_args(tmp_path, "--contexts", "16,40", "--time-limit", "0.3"), log=None)
    res = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0  # a skip is not a failure
    first, second = res["cells"]
    assert first["status"] == R.SKIP_TIME and first["prefill_status"] == R.SKIP_TIME
    assert second["status"].startswith(R.SKIP_TIME) and second.get("not_run")
    assert "skipped (time)" in res["report"]


def test_copy_bandwidth_positive():
    from kvfold.bench.cell import measure_copy_bandwidth
    bw = measure_copy_bandwidth(mib=8, repeats=2, threads=1)
    assert bw["bytes_per_s"] > 0 and bw["best_s"] > 0


def test_decode_bytes_per_token_counts_active_experts_only():
    cfg = C.build_config("bench")
    tensors = {
        "model.embed_tokens.weight": ((4096, 256), 4096 * 256 * 4),
        "model.layers.1.mlp.experts.gate_up_proj": ((8, 256, 256), 8 * 256 * 256 * 4),
        "lm_head.weight": ((4096, 256), 4096 * 256 * 4),
    }
    short, long = C.decode_bytes_per_token(cfg, tensors, 512), C.decode_bytes_per_token(cfg, tensors, 16384)
    assert short["embedding_row"] == 256 * 4
    assert short["routed_experts_active"] == 8 * 256 * 256 * 4 * 2 / 8
    assert short["lm_head"] == 4096 * 256 * 4
    assert long["state"] > short["state"] > 0
    assert short["total"] == short["weights_total"] + short["state"]


def test_cell_status_mapping():
    from kvfold.bench.cell import _is_oom
    assert _is_oom(MemoryError())
    assert _is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert not _is_oom(RuntimeError("shape mismatch"))
    raw = {"status": R.OOM, "wall_s": 1.0, "phases": {"loaded": {"load_s": 0.1, "load_peak_rss": 1,
                                                                 "rss_after_load": 1}, "error": {"oom": True}}}
    rec = R._cell_record("transformers", 4096, raw)
    assert rec["prefill_status"] == R.OOM and rec["decode_status"] == R.OOM
    assert report._prefill_cell(rec) == "OOM"


def test_cli_hooks_register_bench():
    p = argparse.ArgumentParser(prog="kvfold")
    sub = p.add_subparsers(dest="command", required=True)
    R.add_bench_parser(sub)
    a = p.parse_args(["bench", "--config", "medium", "--contexts", "512,4096", "--vs", "transformers",
                      "--decode-tokens", "8", "--time-limit", "30", "--out", "x.json"])
    assert a.command == "bench" and a.config == "medium" and a.contexts == [512, 4096]
    assert a.vs == "transformers" and a.decode_tokens == 8 and a.time_limit == 30.0 and a.out == "x.json"
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--contexts", "0,16"])
