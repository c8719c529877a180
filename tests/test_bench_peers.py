"""`kvfold bench --vs llama.cpp,flyweight` (issue 42 item 2): the GGUF source written from a release-layout
checkpoint, one llama.cpp engine per `--llama-outtype`, flyweight's cell (its server's stream timings),
the peers' table, and peers that cannot run. No real llama.cpp or flyweight runs here: a fake converter,
llama-bench and flyweight CLI stand in, each checking what the bench hands it."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import pytest

from kvfold.bench import configs as C
from kvfold.bench import flyweight as FW
from kvfold.bench import gguf_source as G
from kvfold.bench import llamacpp as LL
from kvfold.bench import peers as P
from kvfold.bench import report_peers as RP
from kvfold.bench import runner as R
from kvfold.bench import vs as VS


# ---- fakes -------------------------------------------------------------------------------------------
# convert_hf_to_gguf.py for a release-layout source: symlinked safetensors with the release's FP8 / FP4
# tensors, the legacy config keys, a tokenizer of vocab_size tokens; the driver's bf16 rule present
# exactly for --outtype bf16. Writes a GGUF-magic file and logs its outtype.
_FAKE_CONVERTER = '''
import argparse, json, os, sys
from pathlib import Path
from safetensors import safe_open
import conversion.base as base
from conversion.deepseek import DeepseekV4Model
ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("--outfile"); ap.add_argument("--outtype")
args = ap.parse_args()
src = Path(args.model)
cfg = json.loads((src / "config.json").read_text())
for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "architectures"):
    assert k in cfg, k
assert base.TextModel().get_vocab_base_pre(None) == "deepseek-v3"
assert (DeepseekV4Model.tensor_force_quant.__name__ == "keep_bf16") == (args.outtype == "bf16")
assert len(json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]) == cfg["vocab_size"]
parts = sorted(src.glob("*.safetensors"))
assert parts and all(p.is_symlink() for p in parts), parts  # linked, not copied
dtypes = {}
for p in parts:
    with safe_open(str(p), "pt") as f:
        for k in f.keys():
            dtypes[k] = str(f.get_slice(k).get_dtype())
assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3" and "layers.1.attn.wq_a.scale" in dtypes
assert dtypes["layers.1.ffn.experts.0.w1.weight"] == "I8" and dtypes["embed.weight"] == "BF16"
Path(args.outfile).write_bytes(b"GGUF" + bytes(60))
with open(os.path.join(os.path.dirname(__file__), "converted.log"), "a") as log:
    log.write(args.outtype + "\\n")
'''

_FAKE_BENCH = '''#!{python}
import json, sys
a = sys.argv[1:]
opt = {{a[i]: a[i + 1] for i in range(0, len(a) - 1) if a[i].startswith("-")}}
p, n, d = int(opt["-p"]), int(opt["-n"]), int(opt["-d"])
ns = int((p * 4e-3 + n * 10e-3) * 1e9) * (2 if "q8_0" in opt["-m"] else 1)  # the q8_0 GGUF runs half as fast
print(json.dumps(dict(build_commit="abc1234", backends="CPU", n_prompt=p, n_gen=n, n_depth=d, n_threads=int(opt["-t"]),
                      samples_ns=[ns], avg_ns=ns, type_k="f16", type_v="f16")))
'''

# a stand-in for the flyweight CLI: --version, and `serve` as an HTTP server with /health, /tokenize (one
# token a character) and a streamed /v1/chat/completions: the chat template adds 5 tokens, prefill takes
# 2 ms a token with a progress frame per 32, and each generated token's chunk carries the server's
# generated_tokens / decode_elapsed_seconds at 5 ms a step (200 tok/s). FAKE_FLYWEIGHT_MODE: exit (refuses
# the model), slow (a prefill that never ends)
_FAKE_FLYWEIGHT = '''#!{python}
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
if sys.argv[1:] == ["--version"]:
    print("flyweight 0.0-fake"); sys.exit(0)
a = sys.argv[1:]
assert a[0] == "serve" and a[a.index("--backend") + 1] == "cpu" and a[a.index("--parallel") + 1] == "1"
assert os.environ["OMP_NUM_THREADS"] == os.environ["FLYWEIGHT_CPU_THREADS"]
mode = os.environ.get("FAKE_FLYWEIGHT_MODE", "ok")
if mode == "exit":
    print("ValueError: gemma4 tensor layout expected", file=sys.stderr); sys.exit(1)
log = os.path.join(os.path.dirname(__file__), "requests.log")
ballast = bytearray(64 << 20)
ballast[::4096] = b"\\1" * len(ballast[::4096])  # a resident set the bench can see

class H(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._json({{"status": "ok"}})
    def _send(self, obj):
        self.wfile.write(("data: " + json.dumps(obj) + "\\n\\n").encode()); self.wfile.flush()
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._json({{"count": len(req["content"]), "tokens": []}})
        text, n = req["messages"][0]["content"], req["max_tokens"]
        with open(log, "a") as f:
            f.write(json.dumps({{"chars": len(text), "max_tokens": n, "progress": req.get("prefill_progress")}}) + "\\n")
        total = len(text) + 5
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        self._send({{"choices": [{{"delta": {{"role": "assistant"}}}}]}})
        done = 0
        self._send({{"type": "ping", "flyweight": {{"prefill": {{"processed": 0, "total": total, "cached": 0}}}}}})
        while done < total:
            step = min(32, total - done)
            time.sleep(step * 0.002 * (1000 if mode == "slow" else 1))
            done += step
            self._send({{"type": "ping", "flyweight": {{"prefill": {{"processed": done, "total": total, "cached": 0}}}}}})
        for k in range(1, n + 1):
            time.sleep(0.001)
            self._send({{"choices": [{{"delta": {{"content": "x"}}}}],
                        "flyweight": {{"generated_tokens": k, "decode_elapsed_seconds": (k - 1) * 0.005}}}})
        self._send({{"choices": [{{"delta": {{}}, "finish_reason": "length"}}]}})
        self.wfile.write(b"data: [DONE]\\n\\n")

HTTPServer(("127.0.0.1", int(a[a.index("--port") + 1])), H).serve_forever()
'''


def _exe(path, text):
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _fake_llama_cpp(root):
    from test_bench import fake_llama_checkout
    src = fake_llama_checkout(root, _FAKE_CONVERTER)
    (src / "build" / "bin").mkdir(parents=True)
    _exe(src / "build" / "bin" / "llama-bench", _FAKE_BENCH)
    return src


def _fake_flyweight(root):
    root.mkdir(parents=True, exist_ok=True)
    return _exe(root / "flyweight", _FAKE_FLYWEIGHT)


def _release_checkpoint(tmp_path):
    """tiny-bench written in the release's layout and formats (as the v4-flash checkpoint is)."""
    from kvfold.bench.real_shapes import random_tensors
    from kvfold.models.deepseek_v4.convert import write_official
    cfg = C.build_config("tiny-bench")
    d = write_official(tmp_path / "ckpt", cfg, random_tensors(cfg, seed=1), max_shard_bytes=1 << 16)
    (d / "bench-meta.json").write_text(json.dumps({"key": "test", "layout": "official"}))
    return d, cfg


# ---- the GGUF source and the llama.cpp engines -----------------------------------------------------
def test_tokenizer_reaches_deepseek_v4s_vocabulary():
    # 2 specials + 256 bytes + 256^2 pairs run out at 65,794 ids; V4's 129,280 need three-symbol tokens
    vocab, merges = G.tokenizer_vocab(129_280)
    assert len(vocab) == 129_280 and sorted(vocab.values()) == list(range(129_280))
    assert len(merges) == 129_280 - 258 and all(a in vocab and b in vocab and a + b in vocab for a, b in merges)
    assert len(merges[-1][0]) == 2 and len(merges[-1][1]) == 1


def test_gguf_source_of_a_release_checkpoint_links_its_tensors(tmp_path):
    ckpt, cfg = _release_checkpoint(tmp_path)
    assert G.is_release_layout(ckpt) and not G.is_release_layout(C.ensure_checkpoint("tiny-bench", tmp_path / "c"))
    dst = G.write_gguf_source(ckpt, tmp_path / "src", "bf16")
    parts = sorted(dst.glob("*.safetensors"))
    assert len(parts) == len(list(ckpt.glob("*.safetensors"))) > 1
    assert all(p.is_symlink() and p.resolve() == (ckpt / p.name).resolve() for p in parts)
    assert (dst / "model.safetensors.index.json").resolve() == (ckpt / "model.safetensors.index.json").resolve()
    conf = json.loads((dst / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV4ForCausalLM"] and conf["vocab_size"] == cfg.vocab_size
    assert conf["compress_ratios"] == list(cfg.compress_ratios) and conf["num_hash_layers"] == 1
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(dst / "tokenizer.json")).get_vocab_size() == cfg.vocab_size
    # the bytes written are the config and the tokenizer: nothing of the tensors is copied
    assert sum(f.stat().st_size for f in dst.iterdir() if not f.is_symlink()) < 1 << 20


def test_q8_0_source_of_a_float_checkpoint_is_fp8(tmp_path):
    # a kvfold-layout float checkpoint: q8_0 gets FP8 matrices (the converter's FP8 -> Q8_0 rule applies)
    ckpt = C.ensure_checkpoint("tiny-bench", tmp_path / "c")
    dst = G.write_gguf_source(ckpt, tmp_path / "q8", "q8_0")
    sizes = C.checkpoint_tensor_sizes(dst)
    assert "layers.1.attn.wq_a.scale" in sizes and "layers.1.ffn.experts.0.w1.scale" in sizes
    assert not (dst / "release").exists()


def test_each_outtype_gets_its_own_cached_gguf(tmp_path):
    ckpt, _ = _release_checkpoint(tmp_path)
    llama = LL.locate(_fake_llama_cpp(tmp_path))
    assert llama.problem is None
    a = LL.ensure_gguf(ckpt, llama, outtype="bf16")
    b = LL.ensure_gguf(ckpt, llama, outtype="q8_0")
    assert a.problem is None and b.problem is None, (a.detail, b.detail)
    assert re.fullmatch(r"model-bf16-[0-9a-f]{16}\.gguf", a.path.name) and b.path.name.startswith("model-q8_0-")
    assert a.path.is_file() and b.path.is_file()  # converting one kept the other
    assert a.info["command"][-2:] == ["--outtype", "bf16"] and b.info["command"][-2:] == ["--outtype", "q8_0"]
    assert a.info["convert_peak_rss_bytes"] > 0 and a.describe()["outtype"] == "bf16"
    again = LL.ensure_gguf(ckpt, llama, outtype="q8_0")
    assert again.cached and again.path == b.path and again.info["key"] == b.info["key"]
    assert (llama.source / "converted.log").read_text().split() == ["bf16", "q8_0"]
    assert LL.engine_name("bf16") == "llama.cpp" and LL.engine_name("q8_0") == "llama.cpp-q8_0"


def test_vs_and_llama_outtype_parsing():
    a = R.build_parser().parse_args(["--vs", "flyweight,llama.cpp,transformers", "--llama-outtype", "q8_0,bf16"])
    assert a.vs == ["transformers", "llama.cpp", "flyweight"] and a.llama_outtype == ["q8_0", "bf16"]
    assert R._engines(a) == ["kvfold", "transformers", "llama.cpp-q8_0", "llama.cpp", "flyweight"]
    assert R._engines(R.build_parser().parse_args(["--vs", "flyweight"])) == ["kvfold", "flyweight"]
    for bad in ("q4_k", "bf16,bf16", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            VS.llama_outtypes(bad)
    assert VS.is_peer("llama.cpp-q8_0") and VS.is_peer("flyweight") and not VS.is_peer("transformers")


# ---- flyweight: what its stream says, and its cell ---------------------------------------------------
def _frame(processed, total):
    return json.dumps({"type": "ping", "flyweight": {"prefill": {"processed": processed, "total": total, "cached": 0}}})


def _token(k, elapsed):
    return json.dumps({"choices": [{"delta": {"content": "y"}}],
                       "flyweight": {"generated_tokens": k, "decode_elapsed_seconds": elapsed}})


def test_stream_timings():
    lines = [(0.0, json.dumps({"choices": [{"delta": {"role": "assistant"}}]})), (0.5, _frame(0, 512)),
             (1.5, _frame(256, 512)), (2.5, _frame(512, 512)), (2.6, _token(1, 0.0)), (2.7, "not json"),
             (2.8, _token(3, 0.2)),  # a chunk holding two tokens (an incomplete UTF-8 one before it)
             (3.0, _token(5, 0.4)), (3.0, json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}]})),
             (3.0, "[DONE]"), (9.0, _token(99, 9.0))]
    ended = []
    st = FW.parse_stream(lines, on_prefill_end=lambda: ended.append(True))
    assert ended == [True] and st.prompt_tokens == st.prefill_tokens == 512
    assert st.prefill_s == pytest.approx(2.0)  # admission frame -> last-token frame, no load or HTTP set-up
    assert st.decode_steps == 4 and st.decode_s == pytest.approx(0.4)  # the first token is the prefill's
    assert st.finish_reason == "length" and not st.errors
    err = FW.parse_stream([(0.0, json.dumps({"error": {"message": "context window exceeded"}}))])
    assert err.errors == ["context window exceeded"] and err.prefill_s is None and err.decode_s is None


def test_repetitions_give_medians():
    def rep(pre_s, dec_s, steps=16):
        return FW.StreamTiming(prompt_tokens=512, prefill_start=0.0, prefill_end=pre_s, generated=steps + 1,
                               decode_elapsed=dec_s)
    s = FW.summarize_reps([rep(1.0, 0.16), rep(2.0, 0.32), rep(4.0, 0.08)])
    assert s["prefill_tok_s"] == pytest.approx(256.0) and s["decode_tok_s"] == pytest.approx(100.0)
    assert sorted(s["prefill_samples_tok_s"]) == pytest.approx([128.0, 256.0, 512.0])
    assert s["prompt_tokens"] == 512 and s["decode_tokens"] == 16 and s["decode_s"] == pytest.approx(0.16)
    assert FW.summarize_reps([]) == {}


def test_prompt_fitting():
    # one token a character, or two characters a token: the prefix is the longest within the target
    for per_token in (1, 2):
        def count(text, per_token=per_token):
            return -(-len(text) // per_token)
        text = FW.fit_text(count, 300, seed=4)
        assert count(text) == 300 and text == FW.random_text(len(text), 4)
    # a token a byte (flyweight's byte-level tokens): a 2- or 3-byte character at the end would leave it short
    for seed in range(8):
        text = FW.fit_text(lambda t: len(t.encode()), 301, seed)
        assert len(text.encode()) == 301
    assert FW.random_text(50, 1) == FW.random_text(80, 1)[:50] and FW.random_text(50, 1) != FW.random_text(50, 2)
    assert len({b for ch in FW.random_text(4000, 0) for b in ch.encode()}) > 150  # most byte values occur


def test_flyweight_command_and_environment(tmp_path):
    fw = FW.Flyweight(tmp_path / "flyweight", version="0.23.1")
    cmd = FW.serve_command(fw, tmp_path / "m.gguf", port=8123, context_window=900)
    assert cmd[:3] == [str(tmp_path / "flyweight"), "serve", str(tmp_path / "m.gguf")]
    text = " ".join(cmd)
    assert "--backend cpu" in text and "--port 8123" in text and "--context 900" in text and "--parallel 1" in text
    env = FW.server_env({"OMP_NUM_THREADS": "8"}, 2)
    assert env["OMP_NUM_THREADS"] == env["FLYWEIGHT_CPU_THREADS"] == "2"
    p = FW.chat_payload("hi", 17)
    assert p["stream"] and p["prefill_progress"] and p["max_tokens"] == 17 and p["temperature"] == 0


def test_flyweight_absent_is_an_unavailable_cell(tmp_path, monkeypatch):
    monkeypatch.delenv(FW.ENV_VAR, raising=False)
    fw = FW.locate(tmp_path / "nowhere")
    assert fw.cli is None and fw.problem.startswith(f"no flyweight CLI in --flyweight {tmp_path / 'nowhere'}")
    assert "flyweight-llm==0.23.1" in fw.problem
    rec = FW.unavailable_record(512, fw.problem)
    assert rec["engine"] == "flyweight" and rec["not_run"] and rec["status"].startswith("unavailable: no flyweight")
    from kvfold.bench.report import _decode_cell, _prefill_cell
    assert _prefill_cell(rec) == _decode_cell(rec) == "unavailable"
    monkeypatch.setenv(FW.ENV_VAR, str(_fake_flyweight(tmp_path / "bin").parent))  # a directory holding it
    found = FW.locate()
    assert found.problem is None and found.version == "0.0-fake" and found.cli.name == "flyweight"


def test_flyweight_cell_with_a_fake_server(tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_FLYWEIGHT_MODE", raising=False)
    fw = FW.locate(_fake_flyweight(tmp_path / "bin"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    rec = FW.run_cell(fw, gguf, 96, decode_tokens=6, threads=1, warmup=8, time_limit=60, mem_limit_bytes=2 << 30,
                      pressure=lambda: 0)
    assert rec["status"] == "ok", rec
    assert rec["template_tokens"] == 5 and rec["prompt_tokens"] == 96 and rec["repetitions"] == 3
    assert rec["decode_tok_s"] == pytest.approx(200.0) and rec["decode_tokens"] == 6  # the server's own clock
    assert 100 < rec["prefill_tok_s"] < 500  # 2 ms a token, and a frame's trip to the client
    assert rec["prefill_peak_rss_bytes"] > (64 << 20) and rec["ru_maxrss_bytes"] > (64 << 20)
    assert rec["load_s"] > 0 and "--port" in rec["commands"][0]
    reqs = [json.loads(x) for x in (tmp_path / "bin" / "requests.log").read_text().splitlines()]
    assert [r["max_tokens"] for r in reqs] == [2, 7, 7, 7] and all(r["progress"] for r in reqs)
    assert [r["chars"] for r in reqs] == [8, 91, 91, 91]  # the warm-up, then CONTEXT - the template's 5


@pytest.mark.parametrize("mode,expect", [("exit", "error: flyweight serve exited: ValueError: gemma4 tensor layout"),
                                         ("slow", R.SKIP_TIME)])
def test_flyweight_cell_failures(tmp_path, monkeypatch, mode, expect):
    monkeypatch.setenv("FAKE_FLYWEIGHT_MODE", mode)
    fw = FW.locate(_fake_flyweight(tmp_path / "bin"))
    t0 = time.perf_counter()
    rec = FW.run_cell(fw, tmp_path / "m.gguf", 64, decode_tokens=4, threads=1, warmup=0, time_limit=5)
    assert rec["status"].startswith(expect) and rec["prefill_status"] == rec["status"] == rec["stopped_by"]
    assert time.perf_counter() - t0 < 30 and "prefill_tok_s" not in rec


# ---- the whole run -----------------------------------------------------------------------------------
def test_vs_llama_cpp_and_flyweight_in_one_run(tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_FLYWEIGHT_MODE", raising=False)
    src = _fake_llama_cpp(tmp_path)
    fly = _fake_flyweight(tmp_path / "bin")
    args = R.build_parser().parse_args([
        "--config", "tiny-bench", "--weights", "quantized", "--contexts", "16,40", "--decode-tokens", "4",
        "--threads", "1", "--warmup", "4", "--time-limit", "120", "--cache-dir", str(tmp_path / "cache"),
        "--out", str(tmp_path / "out.json"), "--vs", "llama.cpp,flyweight", "--llama-outtype", "bf16,q8_0",
        "--llama-cpp", str(src), "--flyweight", str(fly)])
    args.command_line = "pytest"
    assert R.run_bench(args, log=None) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    engines = ["kvfold", "llama.cpp", "llama.cpp-q8_0", "flyweight"]
    assert res["settings"]["engines"] == engines
    assert [(c["context"], c["engine"]) for c in res["cells"]] == [(x, e) for x in (16, 40) for e in engines]
    assert all(c["status"] == "ok" for c in res["cells"]), [c["status"] for c in res["cells"]]
    by = {(c["context"], c["engine"]): c for c in res["cells"]}
    assert by[(16, "llama.cpp")]["decode_tok_s"] == pytest.approx(100.0)
    assert by[(16, "llama.cpp-q8_0")]["decode_tok_s"] == pytest.approx(50.0)  # ran on the q8_0 GGUF
    assert set(res["llama_cpp"]["ggufs"]) == {"bf16", "q8_0"}
    assert res["flyweight"]["gguf"] == res["llama_cpp"]["ggufs"]["bf16"]["gguf"]  # the first outtype's
    # the GGUFs were made from the release-layout checkpoint kvfold's cells load
    assert res["llama_cpp"]["gguf"].startswith(res["kvfold_checkpoint"] + "/llama.cpp/model-bf16-")
    for row in res["rows"]:
        kv = by[(row["context"], "kvfold")]
        fl = by[(row["context"], "flyweight")]
        assert row["peers"]["flyweight"]["decode_ratio"] == pytest.approx(kv["decode_tok_s"] / fl["decode_tok_s"])
        assert row["llama_decode_ratio"] == pytest.approx(kv["decode_tok_s"] / 100.0)
    rep = res["report"]
    assert "kvfold vs llama.cpp, llama.cpp-q8_0, flyweight:" in rep and "flyweight: " in rep
    assert len(re.findall(r"\n +40 \| +flyweight \| +[\d.]+ \| +[\d.]+ \|", rep)) == 1
    assert "q8_0: " in rep and "bf16: " in rep


def test_peers_of_a_model_they_cannot_run_say_so(tmp_path):
    glm = tmp_path / "glm"
    glm.mkdir()
    (glm / "config.json").write_text(json.dumps({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}))
    assert "DeepSeek-V4 checkpoints only, not GlmMoeDsaForCausalLM" in P.dsv4_problem(glm)
    args = R.build_parser().parse_args(["--vs", "llama.cpp,flyweight", "--llama-cpp", str(_fake_llama_cpp(tmp_path))])
    peers, info = VS.prepare_peers(args, glm, R._engines(args), log=lambda m: None)
    assert set(peers) == {"llama.cpp", "flyweight"} and not (glm / "llama.cpp").exists()  # nothing converted
    for e, peer in peers.items():
        rec, hit = peer.run(args, 512, 0, log=lambda m: None)
        assert rec["engine"] == e and rec["status"].startswith("unavailable: the peers' GGUF path converts "
                                                               "DeepSeek-V4 checkpoints only") and hit is None
    assert info["llama_cpp"]["problem"] == info["flyweight"]["problem"]


def test_flyweight_without_llama_cpp_says_it_needs_the_gguf(tmp_path, monkeypatch):
    monkeypatch.delenv(LL.ENV_VAR, raising=False)
    ckpt, _ = _release_checkpoint(tmp_path)
    args = R.build_parser().parse_args(["--vs", "flyweight", "--flyweight", str(_fake_flyweight(tmp_path / "bin"))])
    peers, info = VS.prepare_peers(args, ckpt, R._engines(args), log=lambda m: None)
    assert "llama_cpp" not in info and info["flyweight"]["version"] == "0.0-fake"
    assert peers["flyweight"].why.startswith("needs the GGUF llama.cpp's converter writes (--llama-cpp): "
                                             "no llama.cpp given")


def test_peer_table_rows_and_ratios():
    cells = [{"engine": "kvfold", "context": 512, "status": "ok", "prefill_status": "ok", "decode_status": "ok",
              "prefill_tok_s": 120.0, "decode_tok_s": 6.0, "prefill_peak_rss_bytes": 16 << 30},
             {"engine": "llama.cpp", "context": 512, "status": "ok", "prefill_status": "ok", "decode_status": "ok",
              "prefill_tok_s": 100.0, "decode_tok_s": 5.0, "prefill_peak_rss_bytes": 17 << 30},
             P.unavailable_record("flyweight", 512, "no flyweight CLI")]
    row = {"context": 512, **RP.peer_ratios(cells, cells[0], 512)}
    assert row["peers"]["llama.cpp"]["decode_ratio"] == pytest.approx(1.2) and row["llama_prefill_ratio"] == 1.2
    assert row["peers"]["flyweight"]["decode_ratio"] is None
    res = {"settings": {"engines": ["kvfold", "llama.cpp", "flyweight"]}, "rows": [row], "cells": cells}
    table = RP.format_peer_table(res).splitlines()
    assert [ln.split("|")[1].strip() for ln in table[2:]] == ["kvfold", "llama.cpp", "flyweight"]
    assert [c.strip() for c in table[3].split("|")] == ["512", "llama.cpp", "100.0", "1.20", "17408", "0.94", "5.0",
                                                         "1.20"]
    assert "unavailable" in table[4]
    assert RP.peer_table_lines({"settings": {"engines": ["kvfold"]}}) == []


def test_limited_process_stops_and_reports_its_peak(tmp_path):
    prog = tmp_path / "serve.py"
    prog.write_text("import time\nb = bytearray(40 << 20)\nb[::4096] = b'\\1' * len(b[::4096])\n"
                    "print('up', flush=True)\ntime.sleep(60)\n")
    p = P.start_limited([sys.executable, "-S", str(prog)], 0, dict(os.environ))
    deadline = time.perf_counter() + 30
    pid = None
    while (P.vm_hwm(pid) or 0) < (40 << 20) and time.perf_counter() < deadline:  # the program, not its wrapper
        time.sleep(0.05)
        pid = pid or P.program_pid(p.pid)
    assert P.vm_hwm(pid) > (40 << 20)
    p.stop()
    run = p.result()
    assert not run["timed_out"] and run["returncode"] < 0 and (40 << 20) < run["maxrss"] < (120 << 20)
    assert time.perf_counter() < deadline
