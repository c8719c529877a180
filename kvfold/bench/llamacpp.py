"""`kvfold bench --vs llama.cpp`: the same random checkpoint run by a user's llama.cpp build.

Nothing of llama.cpp ships with kvfold: `--llama-cpp DIR` (or `$KVFOLD_LLAMA_CPP`) names a llama.cpp
checkout and/or build (`bench/get_llama_cpp.sh DIR` builds the one the bench was checked with: the
llama.cpp vendored in the `llama-cpp-python==0.3.36` sdist, which has DeepSeek-V4). From it the bench
uses

* `llama-bench` (found in DIR, DIR/bin, DIR/build/bin, DIR/build/bin/Release) to time the cells, and
* `convert_hf_to_gguf.py` + `gguf-py` (in DIR, its parent, or the source directory a CMake build
  directory's CMakeCache.txt names) to turn the checkpoint into a GGUF, run in a subprocess with this
  Python (it needs torch, numpy, transformers, pyyaml and tqdm: `pip install 'kvfold[bench]'`).

The GGUF source directory (gguf_source.py) is the checkpoint in the release's layout, symlinked when
it already is (v4-flash, and the `-official` checkpoint of `--weights quantized`), plus what the
converter demands besides:

* official release tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`, ...);
* routed experts in FP4 (e2m1 values, one e8m0 scale per 1x32 block): the converter only takes
  them that way and repacks them, bit for bit, into MXFP4, whatever the output type;
* a transformers-style `config.json` plus the legacy keys the converter reads (`compress_ratios`,
  `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`);
* a tokenizer: the bench checkpoint has none. A byte-level BPE tokenizer of exactly `vocab_size`
  tokens is generated (ids 0/1 = bos/eos, then the 256 byte symbols, then merged tokens). Its
  pre-tokenizer hash is, of course, in no list of the converter's, which refuses unknown ones; the
  converter is therefore run through a few-line driver (`_DRIVER`) that sets the pre-tokenizer name to
  `deepseek-v3` (DeepSeek's) before calling the script's own `main()`. llama-bench feeds random
  token ids, so the tokenizer only has to exist and have the right size.

Output types (`--llama-outtype`, one llama.cpp engine each; OUTTYPES):

* `bf16` (engine `llama.cpp`): `--outtype bf16`; every matrix but the MXFP4 experts is BF16, norms
  and vectors F32. The converter forces FP8-sourced matrices to Q8_0 whatever `--outtype`, so the
  driver makes them follow `--outtype bf16` instead (what converting a bf16 cast of the release,
  DeepSeek's `fp8_cast_bf16.py`, gives; FP8 values are exact in bf16);
* `q8_0` (engine `llama.cpp-q8_0`): `--outtype q8_0` and the converter's own rules: FP8 matrices
  (attention, shared experts) Q8_0, bf16 ones (embedding, head, compressors) BF16: the bytes of
  kvfold's `--weights quantized` checkpoint, the MXFP4 experts aside.

The GGUF is cached next to the checkpoint (`<checkpoint>/llama.cpp/model-<outtype>-<key>.gguf`, the
key covering the checkpoint, the converter's source files and this recipe), so it is rebuilt when any
changes and removed with the checkpoint. The converter is lazy but holds the repacked MXFP4 experts
until it writes them: its peak RSS (in the JSON) is about the experts' bytes.

A cell runs `llama-bench -o jsonl -r 3 -t THREADS` twice in fresh processes (three timed repetitions,
their median reported: llama.cpp's first repetition runs slow, so one alone would understate it): `-p CONTEXT -n 0` (the
prefill; llama-bench's own warm-up first runs the same prompt once, untimed) and `-p 0 -n DECODE -d
CONTEXT` (DECODE single-token steps after an untimed CONTEXT-token prefill; warm-up 1 step). Prefill
peak RSS = the prefill process's ru_maxrss (whole process: load, warm-up and prefill; the GGUF is
memory-mapped, so touched weight pages count).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import peers as P
from .deps import INSTALL_HINT
from .gguf_source import gguf_source_config, tokenizer_vocab, write_gguf_source, write_tokenizer  # noqa: F401
from .protocol import SKIP_TIME

ENGINE = "llama.cpp"
ENV_VAR = "KVFOLD_LLAMA_CPP"
UNAVAILABLE = P.UNAVAILABLE
OUTTYPES = ("bf16", "q8_0")  # --llama-outtype: the converter's --outtype of each llama.cpp engine's GGUF
GGUF_OUTTYPE = OUTTYPES[0]
# Bump when the GGUF source directory or the driver changes: cached GGUFs are then rebuilt.
RECIPE_VERSION = 3  # 3: release-layout sources, --outtype q8_0, FP8 as BF16 (2: bf16 matrices; 1: float32)
PRE_TOKENIZER = "deepseek-v3"
_TYPES_MARK = "@@kvfold-gguf-types "
_BENCH_NAMES = ("llama-bench", "llama-bench.exe")


# ---- finding llama.cpp ---------------------------------------------------------------------------
@dataclass
class LlamaCpp:
    """What was found under the directory the user named. `problem` says why it cannot run at all."""
    directory: Path | None
    bench: Path | None = None
    source: Path | None = None  # holds convert_hf_to_gguf.py and gguf-py/
    problem: str | None = None

    @property
    def converter(self) -> Path | None:
        return None if self.source is None else self.source / "convert_hf_to_gguf.py"

    def describe(self) -> dict[str, Any]:
        return {"directory": str(self.directory) if self.directory else None,
                "llama_bench": str(self.bench) if self.bench else None,
                "converter": str(self.converter) if self.converter else None, "problem": self.problem}


def _cmake_source_dir(build: Path) -> Path | None:
    cache = build / "CMakeCache.txt"
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        return None
    for key in ("CMAKE_HOME_DIRECTORY", "llama.cpp_SOURCE_DIR"):
        m = re.search(rf"^{re.escape(key)}:[A-Z]+=(.+)$", text, re.M)
        if m:
            return Path(m.group(1).strip())
    return None


def locate(directory: str | os.PathLike | None) -> LlamaCpp:
    """Find llama-bench and the GGUF converter under `directory` (a llama.cpp checkout, a build
    directory, or a checkout with a `build/` inside); `directory` None reads $KVFOLD_LLAMA_CPP."""
    if directory is None:
        directory = os.environ.get(ENV_VAR) or None
    if directory is None:
        return LlamaCpp(None, problem=f"no llama.cpp given (--llama-cpp DIR or ${ENV_VAR})")
    d = Path(directory).expanduser()
    if not d.is_dir():
        return LlamaCpp(d, problem=f"--llama-cpp {d}: not a directory")
    found = LlamaCpp(d)
    for sub in (".", "bin", "build/bin", "build/bin/Release", "build/bin/RelWithDebInfo"):
        for name in _BENCH_NAMES:
            p = d / sub / name
            if p.is_file() and os.access(p, os.X_OK):
                found.bench = p.resolve()
                break
        if found.bench:
            break
    sources = [d, d.parent]
    for build in (d, d / "build"):
        s = _cmake_source_dir(build)
        if s is not None:
            sources.append(s)
    for s in sources:
        if (s / "convert_hf_to_gguf.py").is_file() and (s / "gguf-py").is_dir():
            found.source = s.resolve()
            break
    missing = []
    if found.bench is None:
        missing.append("no llama-bench binary in DIR, DIR/bin or DIR/build/bin (build the llama-bench target)")
    if found.source is None:
        missing.append("no convert_hf_to_gguf.py + gguf-py/ in DIR, its parent or the CMake source dir")
    if missing:
        found.problem = f"--llama-cpp {d}: " + "; ".join(missing)
    return found


# ---- conversion ------------------------------------------------------------------------------------
# Runs the converter script's own main() after at most two changes: the pre-tokenizer name of the
# generated tokenizer (whose hash the converter cannot know) is fixed, and with outtype bf16 the
# FP8-sourced matrices follow --outtype (the converter forces them to Q8_0). Then prints the GGUF's
# tensor types (informational: skipped if gguf-py cannot read it). argv: source dir, pre name,
# outtype, converter args.
_DRIVER = """\
import json, runpy, sys
src, pre, outtype = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
if outtype == "bf16":
    import gguf
    from conversion.deepseek import DeepseekV4Model
    forced = DeepseekV4Model.tensor_force_quant
    def keep_bf16(self, name, new_name, bid, n_dims):
        if n_dims >= 2 and name in self._dsv4_fp8_dequantized:
            return gguf.GGMLQuantizationType.BF16
        return forced(self, name, new_name, bid, n_dims)
    DeepseekV4Model.tensor_force_quant = keep_bf16
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[4:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    if e.code not in (None, 0):
        raise
try:
    from gguf import GGUFReader
    types = {}
    for t in GGUFReader(sys.argv[sys.argv.index("--outfile") + 1]).tensors:
        n = types.setdefault(t.tensor_type.name, [0, 0])
        n[0] += 1
        n[1] += int(t.n_bytes)
    print(MARK + json.dumps(types))
except Exception:
    pass
""".replace("MARK", repr(_TYPES_MARK))


def engine_name(outtype: str) -> str:
    """The engine of the GGUF of `outtype`: `llama.cpp` for bf16 (the default), `llama.cpp-<outtype>` else."""
    return ENGINE if outtype == GGUF_OUTTYPE else f"{ENGINE}-{outtype}"


def _converter_files(source: Path) -> list[Path]:
    files = [source / "convert_hf_to_gguf.py"]
    for sub in ("conversion/base.py", "conversion/deepseek.py", "gguf-py/gguf/constants.py",
                "gguf-py/gguf/tensor_mapping.py"):
        if (source / sub).is_file():
            files.append(source / sub)
    return files


def gguf_key(checkpoint: Path, source: Path, outtype: str = GGUF_OUTTYPE) -> str:
    """Cache key of the GGUF: the checkpoint's bench metadata, the converter's sources, RECIPE_VERSION
    and the output type."""
    h = hashlib.sha256()
    try:
        meta = json.loads((checkpoint / "bench-meta.json").read_text())
        h.update(json.dumps(meta, sort_keys=True).encode())
    except (OSError, json.JSONDecodeError):
        for f in sorted(checkpoint.glob("*.safetensors")):
            h.update(f"{f.name} {f.stat().st_mtime_ns}".encode())
    h.update(f"recipe {RECIPE_VERSION} {outtype}".encode())
    for f in _converter_files(source):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# modules llama.cpp's converter imports that kvfold itself does not need: the `bench` extra's
_CONVERTER_PACKAGES = {"transformers": "transformers", "yaml": "pyyaml", "tqdm": "tqdm"}


def _conversion_problem(log_text: str, returncode: int | None) -> str:
    """A failed conversion in one line: the converter's last error line, or, when it could not import
    a package of the `bench` extra, which one and how to install it."""
    missing = re.search(r"No module named '([\w.]+)'", log_text)
    package = _CONVERTER_PACKAGES.get(missing.group(1).split(".")[0]) if missing else None
    if package:
        return f"conversion failed: llama.cpp's converter needs the {package} package: {INSTALL_HINT}"
    lines = [ln for ln in log_text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"Error|error|Exception", ln)]
    last = (errs or lines or [f"exit code {returncode}"])[-1].strip()
    return f"conversion failed: {last}"[:400]


@dataclass
class Gguf:
    path: Path | None
    problem: str | None = None
    detail: str = ""
    cached: bool = False
    convert_s: float | None = None
    outtype: str = GGUF_OUTTYPE
    info: dict[str, Any] | None = None  # the sidecar JSON: converter, command, peak RSS, tensor types

    def describe(self) -> dict[str, Any]:
        return {"outtype": self.outtype, "gguf": str(self.path) if self.path else None, "cached": self.cached,
                "convert_s": self.convert_s, "problem": self.problem, **(self.info or {})}


def _stale(cache: Path, outtype: str) -> list[Path]:
    """Earlier GGUFs of this output type (another key) and of recipe 2 (no type in the name)."""
    pat = re.compile(rf"model-({re.escape(outtype)}-)?[0-9a-f]{{16}}\.(gguf|json)")
    return [f for f in cache.glob("model-*") if pat.fullmatch(f.name)]


def _convert_command(llama: LlamaCpp, src: Path, out: Path, outtype: str, python: str | None) -> list[str]:
    return [python or sys.executable, "-c", _DRIVER, str(llama.source), PRE_TOKENIZER, outtype,
            str(src), "--outfile", str(out), "--outtype", outtype]


def _run_converter(cmd: list[str], llama: LlamaCpp, time_limit: float) -> dict[str, Any]:
    """The converter in a fresh process (no memory cap: its peak RSS is reported)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(llama.source / "gguf-py")] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return P.run_limited(cmd, time_limit, 0, env)


def _tensor_types(stdout: str) -> dict[str, Any] | None:
    line = next((ln for ln in stdout.splitlines() if ln.startswith(_TYPES_MARK)), None)
    return json.loads(line[len(_TYPES_MARK):]) if line else None


def ensure_gguf(checkpoint: str | os.PathLike, llama: LlamaCpp, *, outtype: str = GGUF_OUTTYPE,
                time_limit: float = 3600.0, log: Callable[[str], None] | None = None,
                python: str | None = None) -> Gguf:
    """The `outtype` GGUF of the bench checkpoint for `llama`'s converter, written on first use into
    `<checkpoint>/llama.cpp/` and reused while its key matches. Never raises for a failed
    conversion: `problem` says what went wrong (the converter's last error line)."""
    log = log or (lambda m: None)
    checkpoint = Path(checkpoint)
    if llama.source is None:
        return Gguf(None, problem=llama.problem or "no llama.cpp converter", outtype=outtype)
    try:
        key = gguf_key(checkpoint, llama.source, outtype)
    except OSError as e:
        return Gguf(None, problem=f"conversion failed: {e}", outtype=outtype)
    cache = checkpoint / "llama.cpp"
    target = cache / f"model-{outtype}-{key}.gguf"
    sidecar = target.with_suffix(".json")
    if target.is_file():
        info = json.loads(sidecar.read_text()) if sidecar.is_file() else None
        return Gguf(target, cached=True, outtype=outtype, info=info)
    log(f"converting {checkpoint} to a {outtype} GGUF with {llama.converter}")
    cache.mkdir(parents=True, exist_ok=True)
    for old in _stale(cache, outtype):  # an older key: rebuilt below
        old.unlink()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".gguf-src-", dir=cache))
    try:
        try:
            write_gguf_source(checkpoint, work / "src", outtype)
        except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
            return Gguf(None, problem=f"conversion failed: GGUF source: {type(e).__name__}: {e}"[:400],
                        outtype=outtype)
        out = work / "model.gguf"
        cmd = _convert_command(llama, work / "src", out, outtype, python)
        run = _run_converter(cmd, llama, time_limit)
        log_text = (run["stdout"] or "") + (run["stderr"] or "")
        if run["timed_out"]:
            return Gguf(None, problem=f"conversion failed: converter still running after {time_limit:g} s",
                        outtype=outtype)
        if run["returncode"] != 0 or not out.is_file():
            return Gguf(None, problem=_conversion_problem(log_text, run["returncode"]), detail=log_text[-4000:],
                        outtype=outtype)
        os.replace(out, target)
        info = {"key": key, "recipe": RECIPE_VERSION, "converter": str(llama.converter),
                "pre_tokenizer": PRE_TOKENIZER, "command": cmd[:2] + ["<driver>"] + cmd[3:],
                "convert_peak_rss_bytes": run["maxrss"], "convert_wall_s": run["wall_s"],
                "tensor_types": _tensor_types(run["stdout"])}
        sidecar.write_text(json.dumps(info, indent=2))
        return Gguf(target, convert_s=time.perf_counter() - t0, outtype=outtype, info=info)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- llama-bench -----------------------------------------------------------------------------------
def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """The test records of llama-bench's `-o json` (one array) or `-o jsonl` (one object a line)
    output; lines that are not JSON (logs) are ignored."""
    text = text.strip()
    if text.startswith("["):
        try:
            data = json.loads(text)
            return [d for d in data if isinstance(d, dict)]
        except json.JSONDecodeError:
            pass
    out = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("{") and line.endswith("}"):
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(d, dict):
                out.append(d)
    return out


def _test_seconds(t: dict[str, Any]) -> float | None:
    """Seconds of one timed repetition of a llama-bench test: the median of its repetitions (`-r 3`
    unless --llama-bench-args asks for another count)."""
    ns = sorted(x for x in (t.get("samples_ns") or ([t["avg_ns"]] if t.get("avg_ns") else [])) if x)
    return ns[len(ns) // 2] / 1e9 if ns else None


_is_oom_text = P.is_oom_text
_run_limited = P.run_limited  # the name the tests know


LLAMA_REPETITIONS = 3  # timed repetitions per llama-bench test; --llama-bench-args "-r N" overrides


def llama_bench_command(llama: LlamaCpp, gguf: Path, *, prompt: int, gen: int, depth: int, threads: int,
                        extra: list[str] | None = None) -> list[str]:
    return [str(llama.bench), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
            "-t", str(threads), "-r", str(LLAMA_REPETITIONS), "-o", "jsonl", *(extra or [])]


def _failure(run: dict[str, Any], what: str) -> str:
    return P.failure_status(run, "llama-bench", what)


_LLAMA_BENCH_KEYS = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
                     "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "flash_attn")


def _bench_test(llama: LlamaCpp, gguf: Path, rec: dict[str, Any], *, prompt: int, gen: int, depth: int,
                threads: int, extra: list[str] | None, time_limit: float, mem_limit_bytes: int,
                env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any] | None, float | None]:
    """One llama-bench process for one test (its command logged in rec["commands"]): (the run, the
    test record matching prompt/gen/depth or None, that test's seconds or None)."""
    cmd = llama_bench_command(llama, gguf, prompt=prompt, gen=gen, depth=depth, threads=threads, extra=extra)
    rec["commands"].append(shlex.join(cmd))
    run = _run_limited(cmd, time_limit, mem_limit_bytes, env)
    tests = parse_llama_bench(run["stdout"])
    if gen:
        test = next((t for t in tests if t.get("n_gen") == gen and t.get("n_depth") == depth), None)
    else:
        test = next((t for t in tests if t.get("n_prompt") == prompt and not t.get("n_gen")), None)
    return run, test, (_test_seconds(test) if test else None)


def _run_status(run: dict[str, Any], secs: float | None, what: str, short: str) -> str | None:
    """Why a llama-bench run gave no timing (`what` = prefill / decode, `short` = pp / tg), or None."""
    if run["returncode"] == 0 and secs is not None:
        return None
    if run["returncode"] != 0 or run["timed_out"]:
        return _failure(run, what)
    return f"error: llama-bench {what}: no {short} test in its output"


_finish_record = P.finish_record


def run_cell(llama: LlamaCpp, gguf: Path, context: int, *, decode_tokens: int, threads: int,
             time_limit: float, mem_limit_bytes: int = 0, env: dict[str, str] | None = None,
             pressure: Callable[[], int | None] | None = None, extra: list[str] | None = None,
             engine: str = ENGINE) -> dict[str, Any]:
    """One llama.cpp cell as a record of the bench's JSON (the keys kvfold's cells have where
    llama-bench measures the same thing). Never raises."""
    env = dict(os.environ if env is None else env)
    psi0 = pressure() if pressure else None
    rec = P.new_record(engine, context, mem_limit_bytes)
    t0 = time.perf_counter()
    common = dict(threads=threads, extra=extra, mem_limit_bytes=mem_limit_bytes, env=env)

    run, pp, secs = _bench_test(llama, gguf, rec, prompt=context, gen=0, depth=0, time_limit=time_limit, **common)
    status = _run_status(run, secs, "prefill", "pp")
    if status:
        rec["prefill_status"] = rec["decode_status"] = status
        return _finish_record(rec, status, run["stderr"] or run["stdout"], t0, psi0, pressure)
    rec.update(prefill_status="ok", prefill_s=secs, prefill_tok_s=context / secs, prefill_samples_ns=pp.get("samples_ns"),
               prefill_peak_rss_bytes=run["maxrss"], rss_before_prefill_bytes=None,
               prefill_peak_over_loaded_bytes=None, prefill_wall_s=run["wall_s"],
               llama_bench={k: pp.get(k) for k in _LLAMA_BENCH_KEYS})
    if decode_tokens <= 0:
        rec["decode_status"] = "not run (--decode-tokens 0)"
        return _finish_record(rec, "ok", "", t0, psi0, pressure)
    left = time_limit - (time.perf_counter() - t0)
    if left <= 0:
        rec["decode_status"] = SKIP_TIME
        return _finish_record(rec, "partial: decode " + SKIP_TIME, "", t0, psi0, pressure)

    run, tg, secs = _bench_test(llama, gguf, rec, prompt=0, gen=decode_tokens, depth=context, time_limit=left,
                                **common)
    status = _run_status(run, secs, "decode", "tg")
    if status:
        rec["decode_status"] = status
        return _finish_record(rec, "partial: decode " + status, run["stderr"] or run["stdout"], t0, psi0, pressure)
    rec.update(decode_status="ok", decode_tokens=decode_tokens, decode_s=secs, decode_tok_s=decode_tokens / secs,
               decode_samples_ns=tg.get("samples_ns"),
               decode_peak_rss_bytes=run["maxrss"], decode_wall_s=run["wall_s"])
    return _finish_record(rec, "ok", "", t0, psi0, pressure)


def unavailable_record(context: int, why: str, engine: str = ENGINE) -> dict[str, Any]:
    return P.unavailable_record(engine, context, why)
