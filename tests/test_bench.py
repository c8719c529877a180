"""`kvfold bench` harness: end to end on the micro `tiny-bench` config (fresh subprocess cells,
both engines), time-limit handling, the copy-bandwidth probe and the summary arithmetic."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvfold.bench import configs as C
from kvfold.bench import report
from kvfold.bench import runner as R
from helpers import fp32_paths_bound



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
        # prefill timed as the peers' cells time theirs: the median of 3 runs after the warm-up
        samples = sorted(c["prefill_samples_s"])
        assert len(samples) == res["settings"]["prefill_runs"] == 3 and c["prefill_s"] == samples[1]
        assert f"{samples[0]:.2f}-{samples[2]:.2f}" in report.format_noise_table(res)
        # the spread of the steps: 10th and 90th percentile around the median
        assert c["decode_step_p10_s"] <= c["decode_step_median_s"] <= c["decode_step_p90_s"]
    spread = f"{1 / cells[0]['decode_step_p90_s']:.1f}-{1 / cells[0]['decode_step_p10_s']:.1f}"
    assert "decode p90-p10 tok/s" in report.format_noise_table(res) and spread in report.format_noise_table(res)
    assert R.build_parser().parse_args([]).decode_tokens == 128  # kvfold's decode: the median of 128 steps
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
    # kvfold and transformers in fp32: two evaluations of the same logits (the sanity prompt keeps the
    # indexer's top-k margins far above fp32 noise, configs.SANITY_TOKENS)
    bound = fp32_paths_bound(torch.tensor(san["logits_scale"]), C.build_config("tiny-bench").num_hidden_layers)
    assert san["max_abs_diff_prefill"] < bound and san["max_abs_diff_decode"] < bound
    rep = res["report"]
    assert "kvfold prefill tok/s" in rep and "hf decode tok/s" in rep and "decode flatness kvfold" in rep
    assert res["machine"]["cpu_count"] >= 1 and res["machine"]["torch"]
    assert res["machine"]["kvfold_native"] is True and "kvfold native CPU kernels on" in rep
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


def test_quantized_weights_run_the_official_fp8_fp4_checkpoint(tmp_path):
    rc = R.run_bench(_args(tmp_path, "--contexts", "16", "--weights", "quantized", "--bandwidth", "on"), log=None)
    res = json.loads((tmp_path / "out.json").read_text())
    (cell,) = res["cells"]
    assert rc == 0 and cell["status"] == "ok" and res["settings"]["kvfold_weights"] == "quantized"
    official = C.checkpoint_tensor_sizes(res["kvfold_checkpoint"])
    assert res["kvfold_checkpoint"].endswith("-official") and "embed.weight" in official
    # FP8 attention and FP4 experts: fewer bytes than the float checkpoint, counted as read per token
    assert res["model"]["kvfold_weight_bytes"] < res["model"]["weight_bytes"]
    float_tensors = C.checkpoint_tensor_sizes(res["checkpoint"])
    cfg = C.build_config("tiny-bench")
    per = res["decode_bytes_per_token"]["16"]
    assert per == C.decode_bytes_per_token(cfg, official, 16)
    assert per["routed_experts_active"] < C.decode_bytes_per_token(cfg, float_tensors, 16)["routed_experts_active"] / 6
    assert per["attention"] > 0 and per["lm_head"] > 0 and per["embedding_row"] > 0
    # the resident bytes per parameter the cell measured at load, in the report
    assert cell["weight_bytes"] < 4 * cell["parameters"] and "bytes/parameter" in res["report"]
    assert cell["decode_fraction_of_copy_bandwidth"] > 0
    again = C.ensure_official_checkpoint(C.ensure_checkpoint("tiny-bench", tmp_path / "cache", 0))
    assert str(again) == res["kvfold_checkpoint"]


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
    assert a.vs == ["transformers"] and a.decode_tokens == 8 and a.time_limit == 30.0 and a.out == "x.json"
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--contexts", "0,16"])
    a = p.parse_args(["bench", "--vs", "llama.cpp,transformers", "--llama-cpp", "/opt/llama.cpp"])
    assert a.vs == ["transformers", "llama.cpp"] and a.llama_cpp == "/opt/llama.cpp"
    assert p.parse_args(["bench"]).vs == []
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--vs", "vllm"])


# ---- --vs llama.cpp: a fake llama.cpp directory (no real build needed) ------------------------------
from kvfold.bench import llamacpp as LL  # noqa: E402

# one record of a real llama-bench -o jsonl (build 0c1e570, CPU), cut to the fields the bench reads and a few more
_JSONL_PP = ('{"build_commit": "abc1234", "build_number": 1, "cpu_info": "fake CPU", "backends": "CPU", '
             '"model_type": "deepseek4 ?B MXFP4 MoE", "model_size": 18000000, "model_n_params": 7200000, '
             '"n_batch": 2048, "n_ubatch": 512, "n_threads": 1, "type_k": "f16", "type_v": "f16", '
             '"flash_attn": -1, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "test_time": "2025-01-01T00:00:00Z", '
             '"avg_ns": 250000000, "stddev_ns": 0, "avg_ts": 2048.0, "stddev_ts": 0.0, '
             '"samples_ns": [ 250000000 ],"samples_ts": [ 2048 ]}')

_FAKE_BENCH = '''#!{python}
# a stand-in for llama-bench: parses the arguments the bench passes, prints one -o jsonl record whose
# times follow from them (prefill 4 ms/token, decode 10 ms/token), or misbehaves on request
import json, os, sys, time
a = sys.argv[1:]
opt = {{a[i]: a[i + 1] for i in range(0, len(a) - 1) if a[i].startswith("-")}}
p, n, d, t = int(opt["-p"]), int(opt["-n"]), int(opt["-d"]), int(opt["-t"])
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
log = open(os.path.join(os.path.dirname(__file__), "calls.log"), "a")
log.write(" ".join(a) + "\\n")
log.close()
print("load_tensors: loading model", file=sys.stderr)
if not os.path.isfile(opt["-m"]) or open(opt["-m"], "rb").read(4) != b"GGUF":
    print("error: failed to load model", file=sys.stderr); sys.exit(1)
if mode == "fail":
    print("llama_model_load: error loading model: unknown tensor", file=sys.stderr); sys.exit(1)
if mode == "slow" and p >= 64:
    time.sleep(60)
if mode == "decode-fail" and n > 0:
    print("test_gen: failed to decode generation batch, res = -3", file=sys.stderr); sys.exit(1)
if mode == "oom":
    print("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 999", file=sys.stderr)
    sys.exit(1)
ns = int((p * 4e-3 + n * 10e-3) * 1e9)
rec = json.loads({pp!r})
rec.update(n_prompt=p, n_gen=n, n_depth=d, n_threads=t, avg_ns=ns, samples_ns=[ns],
           avg_ts=(p + n) / ns * 1e9, samples_ts=[(p + n) / ns * 1e9])
print(json.dumps(rec))
'''

_FAKE_CONVERTER = '''
# a stand-in for convert_hf_to_gguf.py: checks the directory it is given as the DeepSeek-V4 converter
# needs it (official names, FP4 experts with scales, bf16 matrices, fp32 biases, legacy config keys, a tokenizer of
# vocab_size tokens, the pre-tokenizer patched by the driver) and writes a GGUF-magic file
import argparse, json, sys
from pathlib import Path
from safetensors import safe_open
import conversion.base as base
ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("--outfile"); ap.add_argument("--outtype")
args = ap.parse_args()
src = Path(args.model)
if (src / "FAIL").exists() or "FAKE_CONVERT_FAIL" in __import__("os").environ:
    raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
if "FAKE_CONVERT_NO_MODULE" in __import__("os").environ:  # as an `import transformers` would fail
    missing = __import__("os").environ["FAKE_CONVERT_NO_MODULE"]
    raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
cfg = json.loads((src / "config.json").read_text())
for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "architectures"):
    assert k in cfg, k
assert base.TextModel().get_vocab_base_pre(None) == "deepseek-v3"
tok = json.loads((src / "tokenizer.json").read_text())
n_tok = len(tok["model"]["vocab"])
assert n_tok == cfg["vocab_size"], (n_tok, cfg["vocab_size"])
with safe_open(str(src / "model.safetensors"), "pt") as f:
    keys = set(f.keys())
    assert "embed.weight" in keys and "head.weight" in keys and "layers.0.ffn.gate.tid2eid" in keys
    w = f.get_tensor("layers.1.ffn.experts.0.w1.weight")
    s = f.get_tensor("layers.1.ffn.experts.0.w1.scale")
    assert w.element_size() == 1 and s.element_size() == 1 and s.shape[-1] * 16 == w.shape[-1], (w.shape, s.shape)
    assert str(f.get_tensor("layers.1.attn.wq_a.weight").dtype) == "torch.bfloat16"
    assert str(f.get_tensor("head.weight").dtype) == "torch.bfloat16"
    assert str(f.get_tensor("hc_head_fn").dtype) == "torch.float32"
    assert args.outtype == "bf16"
from conversion.deepseek import DeepseekV4Model
assert DeepseekV4Model.tensor_force_quant.__name__ == "keep_bf16"  # the driver's bf16 rule is in place
Path(args.outfile).write_bytes(b"GGUF" + bytes(60))
print("INFO:hf-to-gguf:Model successfully exported")
'''


def fake_llama_checkout(root, converter: str):
    """root/llama.cpp: the converter script `converter`, gguf-py/ and the conversion/ modules the bench's
    driver imports (conversion/deepseek.py: it keeps FP8-sourced matrices BF16 through it)."""
    src = root / "llama.cpp"
    (src / "gguf-py" / "gguf").mkdir(parents=True)
    (src / "gguf-py" / "gguf" / "__init__.py").write_text("")
    (src / "conversion").mkdir()
    (src / "conversion" / "__init__.py").write_text("")
    (src / "conversion" / "base.py").write_text(
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n        raise NotImplementedError\n")
    (src / "conversion" / "deepseek.py").write_text(
        "class DeepseekV4Model:\n    def tensor_force_quant(self, name, new_name, bid, n_dims):\n        return False\n")
    (src / "convert_hf_to_gguf.py").write_text(converter)
    return src


def _fake_llama_cpp(root, *, build_dir: bool = False):
    """A llama.cpp checkout (fake_llama_checkout) whose llama-bench is a script. build_dir=True puts
    llama-bench in a separate CMake build dir whose cache names the checkout."""
    import sys
    src = fake_llama_checkout(root, _FAKE_CONVERTER)
    bindir = (root / "build" / "bin") if build_dir else (src / "build" / "bin")
    bindir.mkdir(parents=True)
    exe = bindir / "llama-bench"
    exe.write_text(_FAKE_BENCH.format(python=sys.executable, pp=_JSONL_PP))
    exe.chmod(0o755)
    if build_dir:
        (root / "build" / "CMakeCache.txt").write_text(f"# cache\nCMAKE_HOME_DIRECTORY:INTERNAL={src}\n")
        return root / "build"
    return src


def test_parse_llama_bench_output():
    pp = json.loads(_JSONL_PP)
    # -o json: one array (pretty-printed); -o jsonl: one object a line, with log lines around
    as_json = json.dumps([pp, dict(pp, n_prompt=0, n_gen=64, n_depth=512)], indent=2)
    assert [t["n_gen"] for t in LL.parse_llama_bench(as_json)] == [0, 64]
    as_jsonl = "main: loading\n" + _JSONL_PP + "\n" + json.dumps(dict(pp, n_gen=64)) + "\nllama_perf: done\n"
    tests = LL.parse_llama_bench(as_jsonl)
    assert len(tests) == 2 and tests[0]["n_prompt"] == 512
    assert LL._test_seconds(tests[0]) == pytest.approx(0.25)
    assert LL.parse_llama_bench("error: failed to load model\n") == []
    assert LL._test_seconds(dict(pp, samples_ns=[3e8, 1e8, 2e8])) == pytest.approx(0.2)  # -r 3: the median


def test_locate_checkout_and_build_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(LL.ENV_VAR, raising=False)
    assert "no llama.cpp given" in LL.locate(None).problem
    src = _fake_llama_cpp(tmp_path / "a")
    found = LL.locate(src)
    assert found.problem is None and found.bench.name == "llama-bench" and found.source == src.resolve()
    build = _fake_llama_cpp(tmp_path / "b", build_dir=True)  # a build dir elsewhere: source from CMakeCache
    found = LL.locate(build)
    assert found.problem is None and found.source == (tmp_path / "b" / "llama.cpp").resolve()
    monkeypatch.setenv(LL.ENV_VAR, str(build))
    assert LL.locate(None).bench == found.bench
    empty = tmp_path / "empty"
    empty.mkdir()
    why = LL.locate(empty).problem
    assert "no llama-bench binary" in why and "no convert_hf_to_gguf.py" in why
    assert "not a directory" in LL.locate(tmp_path / "nope").problem


def test_generated_tokenizer_has_exactly_vocab_size_tokens(tmp_path):
    from tokenizers import Tokenizer
    LL.write_tokenizer(tmp_path, 600, bos_id=0, eos_id=1)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 600
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == 0 and tok.token_to_id("<｜end▁of▁sentence｜>") == 1
    ids = tok.encode("hello, wörld").ids
    assert all(2 <= i < 600 for i in ids) and tok.decode(ids) == "hello, wörld"
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    with pytest.raises(ValueError):
        LL.tokenizer_vocab(100)


def test_gguf_source_config_has_the_converters_keys():
    cfg = C.build_config("bench")
    d = LL.gguf_source_config(cfg)
    assert d["compress_ratios"] == [0, 4, 128, 4] and d["num_hash_layers"] == 1
    assert d["qk_rope_head_dim"] == 32 and d["architectures"] == ["DeepseekV4ForCausalLM"]
    assert d["rope_scaling"]["type"] == "yarn" and d["rope_scaling"]["factor"] == 16
    assert d["rope_scaling"]["original_max_position_embeddings"] == 65536


def test_vs_llama_cpp_end_to_end_with_a_fake_build(tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_LLAMA_MODE", raising=False)
    build = _fake_llama_cpp(tmp_path, build_dir=True)
    rc = R.run_bench(_args(tmp_path, "--contexts", "16,40", "--vs", "llama.cpp", "--llama-cpp", str(build),
                           "--time-limit", "120", "--llama-bench-args", "-ctk q8_0 -ctv q8_0"), log=None)
    res = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0 and res["settings"]["engines"] == ["kvfold", "llama.cpp"]
    assert [(c["context"], c["engine"]) for c in res["cells"]] == [
        (16, "kvfold"), (16, "llama.cpp"), (40, "kvfold"), (40, "llama.cpp")]
    info = res["llama_cpp"]
    assert info["problem"] is None and info["gguf_cached"] is False
    gguf = tmp_path / "cache" / "bench-tiny-bench" / "llama.cpp"
    assert info["gguf"].startswith(str(gguf)) and open(info["gguf"], "rb").read(4) == b"GGUF"
    by = {(c["context"], c["engine"]): c for c in res["cells"]}
    for ctx in (16, 40):
        lc = by[(ctx, "llama.cpp")]
        assert lc["status"] == "ok"
        # the fake's clock: prefill 4 ms/token, decode 10 ms/token
        assert lc["prefill_tok_s"] == pytest.approx(250.0) and lc["decode_tok_s"] == pytest.approx(100.0)
        assert lc["prefill_peak_rss_bytes"] > 0 and lc["llama_bench"]["build_commit"] == "abc1234"
        assert lc["llama_bench"]["n_threads"] == 1  # the bench's --threads reached llama-bench
        row = next(r for r in res["rows"] if r["context"] == ctx)
        kv = by[(ctx, "kvfold")]
        assert row["llama_prefill_ratio"] == pytest.approx(kv["prefill_tok_s"] / 250.0)
        assert row["llama_decode_ratio"] == pytest.approx(kv["decode_tok_s"] / 100.0)
    calls = (build / "bin" / "calls.log").read_text().splitlines()
    assert [c.split(" -t ")[0].split(" -p ")[1] for c in calls] == [
        "16 -n 0 -d 0", "0 -n 4 -d 16", "40 -n 0 -d 0", "0 -n 4 -d 40"]
    assert all(c.endswith(" -r 3 -o jsonl -ctk q8_0 -ctv q8_0") for c in calls)  # the median of 3, by default
    rep = res["report"]
    assert "kvfold vs llama.cpp:" in rep and "kv/peer" in rep  # the peers' table: a row per context and engine
    import re
    assert len(re.findall(r"\| +llama\.cpp \| +250\.0 \| +[\d.]+ \|", rep)) == 2  # its prefill and kv/peer
    assert "build abc1234" in rep and "MXFP4" in rep
    # a second run reuses the GGUF
    R.run_bench(_args(tmp_path, "--contexts", "16", "--vs", "llama.cpp", "--llama-cpp", str(build),
                      "--decode-tokens", "0"), log=None)
    again = json.loads((tmp_path / "out.json").read_text())
    assert again["llama_cpp"]["gguf_cached"] is True and again["llama_cpp"]["gguf"] == info["gguf"]
    assert again["cells"][1]["status"] == "ok" and again["cells"][1]["decode_status"].startswith("not run")


def test_vs_llama_cpp_unavailable_says_why_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.delenv(LL.ENV_VAR, raising=False)
    rc = R.run_bench(_args(tmp_path, "--contexts", "16", "--vs", "llama.cpp", "--time-limit", "120"), log=None)
    res = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0
    kv, lc = res["cells"]
    assert kv["status"] == "ok"
    assert lc["status"].startswith("unavailable: no llama.cpp given") and lc["not_run"]
    assert res["llama_cpp"]["problem"].startswith("no llama.cpp given")
    from kvfold.bench.report_peers import format_peer_table
    assert "unavailable" in format_peer_table(res) and "llama.cpp: no llama.cpp given" in res["report"]


def test_llama_cpp_conversion_failure_is_reported(tmp_path, monkeypatch):
    src = _fake_llama_cpp(tmp_path)
    ckpt = C.ensure_checkpoint("tiny-bench", tmp_path / "cache", 0)
    monkeypatch.setenv("FAKE_CONVERT_FAIL", "1")
    g = LL.ensure_gguf(ckpt, LL.locate(src))
    assert g.path is None and g.problem == (
        "conversion failed: NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
    assert not list((ckpt / "llama.cpp").glob("*.gguf")) and not list((ckpt / "llama.cpp").glob(".gguf-src-*"))


@pytest.mark.parametrize("mode,expect", [("fail", "error: llama-bench prefill: llama_model_load: error loading model"),
                                         ("oom", R.OOM), ("slow", R.SKIP_TIME)])
def test_llama_cpp_cell_failures(tmp_path, monkeypatch, mode, expect):
    src = _fake_llama_cpp(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    rec = LL.run_cell(LL.locate(src), gguf, 64, decode_tokens=4, threads=1, time_limit=3.0)
    assert rec["status"].startswith(expect) and rec["prefill_status"] == rec["status"]
    assert report._prefill_cell(rec) == {"fail": "error", "oom": "OOM", "slow": "skipped (time)"}[mode]
    if mode == "slow":
        assert rec["wall_s"] < 30  # killed at the limit


def test_llama_cpp_decode_failure_keeps_the_prefill(tmp_path, monkeypatch):
    src = _fake_llama_cpp(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("FAKE_LLAMA_MODE", "decode-fail")
    rec = LL.run_cell(LL.locate(src), gguf, 16, decode_tokens=4, threads=1, time_limit=30.0)
    assert rec["status"] == "partial: decode error: llama-bench decode: test_gen: failed to decode generation batch, res = -3"
    assert rec["prefill_status"] == "ok" and rec["prefill_tok_s"] == pytest.approx(250.0)
    assert report._decode_cell(rec) == "error" and report._prefill_cell(rec) == "250.0"
    monkeypatch.delenv("FAKE_LLAMA_MODE")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE")
    rec = LL.run_cell(LL.locate(src), bad, 16, decode_tokens=4, threads=1, time_limit=30.0)
    assert rec["status"] == "error: llama-bench prefill: error: failed to load model"


def test_llama_cpp_peak_rss_is_the_programs_own(tmp_path):
    # Linux keeps a process's peak RSS across execve, so a program started straight from this big test
    # process would report at least this process's RSS; the bench's wrapper reports the program's own
    import os
    import resource
    import sys
    prog = tmp_path / "alloc.py"
    prog.write_text("b = bytearray(48 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\n")
    big = bytearray(160 << 20)  # make sure this process is well above what the program uses
    big[::4096] = b"\1" * len(big[::4096])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > (160 << 20)
    run = LL._run_limited([sys.executable, "-S", str(prog)], 60, 0, dict(os.environ))
    assert run["returncode"] == 0 and run["stderr"] == ""
    assert (48 << 20) < run["maxrss"] < (100 << 20)
    del big


# ---- the `bench` extra: transformers / openai are optional --------------------------------------------
_NEEDS = "error: kvfold bench --vs transformers needs the transformers package: pip install 'kvfold[bench]'"


def test_vs_transformers_without_the_package_stops_with_how_to_install(tmp_path, monkeypatch, capsys):
    import sys

    from kvfold.bench.deps import MissingPackageError
    from kvfold.cli import main
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an uninstalled package looks like to import
    argv = ["bench", "--config", "tiny-bench", "--contexts", "16", "--vs", "transformers",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out.json")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == _NEEDS
    assert R.main(argv[1:]) == 2  # python -m kvfold.bench: the same
    assert capsys.readouterr().err.strip() == _NEEDS
    with pytest.raises(MissingPackageError, match="pip install 'kvfold\\[bench\\]'"):
        R.run_bench(_args(tmp_path, "--vs", "llama.cpp,transformers"), log=None)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out.json").exists()  # stopped before any work


def test_llama_cpp_converter_without_a_bench_package_says_which(tmp_path, monkeypatch):
    src = _fake_llama_cpp(tmp_path)
    ckpt = C.ensure_checkpoint("tiny-bench", tmp_path / "cache", 0)
    monkeypatch.setenv("FAKE_CONVERT_NO_MODULE", "transformers")
    g = LL.ensure_gguf(ckpt, LL.locate(src))
    assert g.path is None and g.problem == (
        "conversion failed: llama.cpp's converter needs the transformers package: pip install 'kvfold[bench]'")
    assert "No module named 'transformers'" in g.detail


_WITHOUT_EXTRA = '''
import json, sys, threading, time, urllib.request
tried = []
class Uninstalled:  # transformers and openai look uninstalled; every attempt to import them is recorded
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("transformers", "openai"):
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Uninstalled())
import argparse, kvfold, uvicorn
from kvfold.cli import main
from kvfold.server import add_serve_parser, build_app
assert main(["generate", "--model", "tiny-random", "--prompt", "hi", "--max-new-tokens", "3"]) == 0
p = argparse.ArgumentParser()
add_serve_parser(p.add_subparsers(dest="command"))
server = uvicorn.Server(uvicorn.Config(build_app(p.parse_args(["serve", "--model", "tiny-random"])), host="127.0.0.1",
                                       port=0, log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.01)
url = "http://127.0.0.1:%d/v1/" % server.servers[0].sockets[0].getsockname()[1]
http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
assert json.load(http.open(url + "models"))["data"][0]["id"] == "tiny-random"
body = json.dumps({"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}).encode()
req = urllib.request.Request(url + "completions", body, {"Content-Type": "application/json"})
assert json.load(http.open(req))["usage"]["completion_tokens"] >= 1
server.should_exit = True
assert main(["bench", "--config", "tiny-bench", "--contexts", "8", "--decode-tokens", "1", "--warmup", "0",
             "--threads", "1", "--cache-dir", sys.argv[1] + "/cache", "--out", sys.argv[1] + "/out.json"]) == 0
print("TRIED", json.dumps(tried))
'''


def test_kvfold_runs_without_the_bench_extra(tmp_path):
    # import kvfold, kvfold generate, kvfold serve and a kvfold-only bench, with transformers and openai
    # unimportable: they are the `bench` extra's, not the library's
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRA, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("TRIED ")[-1]) == []  # nothing even tried to import them
    assert json.loads((tmp_path / "out.json").read_text())["cells"][0]["status"] == "ok"


def test_prefill_spread_reads_every_engines_samples():
    # kvfold's runs (s), llama-bench's samples (ns) and flyweight's repetitions (tok/s) alike
    assert report._prefill_range_s({"prefill_samples_s": [2.0, 1.5, 3.25]}) == "1.50-3.25"
    assert report._prefill_range_s({"prefill_samples_ns": [2e9, 4e9]}) == "2.00-4.00"
    assert report._prefill_range_s({"prefill_samples_tok_s": [256.0, 128.0], "prompt_tokens": 512}) == "2.00-4.00"
    assert report._prefill_range_s({"prefill_samples_s": [2.0]}) == "-"
