"""`kvfold bench --vs llama.cpp`: the same random checkpoint run by a user's llama.cpp build.

Nothing of llama.cpp ships with kvfold: `--llama-cpp DIR` (or `$KVFOLD_LLAMA_CPP`) names a llama.cpp
checkout and/or build. From it the bench uses

* `llama-bench` (found in DIR, DIR/bin, DIR/build/bin, DIR/build/bin/Release) to time the cells, and
* `convert_hf_to_gguf.py` + `gguf-py` (in DIR, its parent, or the source directory a CMake build
  directory's CMakeCache.txt names) to turn the checkpoint into a GGUF, run in a subprocess with this
  Python (it needs torch, numpy, transformers, pyyaml and tqdm: `pip install 'kvfold[bench]'`).

The GGUF source directory written for llama.cpp's DeepSeek-V4 converter differs from the bench
checkpoint in what the converter demands, and nothing else:

* official release tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`, ...);
* routed experts in FP4 (e2m1 values, one e8m0 scale per 1x32 block): the converter only takes
  them that way and repacks them, bit for bit, into MXFP4. Every other weight matrix is bf16, as
  the release stores its unquantized tensors and as kvfold's `--weights quantized` checkpoint holds
  them (the converter runs with `--outtype bf16`, and keeps norms and 1-D tensors float32). So
  llama.cpp runs the bench model with its experts rounded to FP4 and its other matrices to bf16:
  the same shapes and cost structure, not bit-identical weights;
* a transformers-style `config.json` plus the legacy keys the converter reads (`compress_ratios`,
  `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`);
* a tokenizer: the bench checkpoint has none. A byte-level BPE tokenizer of exactly `vocab_size`
  tokens is generated (ids 0/1 = bos/eos, then the 256 byte symbols, then two-symbol merges). Its
  pre-tokenizer hash is, of course, in no list of the converter's, which refuses unknown ones; the
  converter is therefore run through a few-line driver (`_DRIVER`) that sets the pre-tokenizer name to
  `deepseek-v3` (DeepSeek's) before calling the script's own `main()`. llama-bench feeds random
  token ids, so the tokenizer only has to exist and have the right size.

The GGUF is cached next to the checkpoint (`<checkpoint>/llama.cpp/model-<key>.gguf`, the key covering
the checkpoint, the converter's source files and this recipe), so it is rebuilt when any changes
and removed with the checkpoint.

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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .deps import INSTALL_HINT
from .protocol import OOM, SKIP_TIME

ENGINE = "llama.cpp"
ENV_VAR = "KVFOLD_LLAMA_CPP"
UNAVAILABLE = "unavailable"
# Bump when the GGUF source directory written below changes: cached GGUFs are then rebuilt.
GGUF_OUTTYPE = "bf16"
RECIPE_VERSION = 2  # 2: bf16 matrices besides the FP4 experts (1: float32)
PRE_TOKENIZER = "deepseek-v3"
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


# ---- the GGUF source directory -------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tokenizer_vocab(vocab_size: int, bos_id: int = 0, eos_id: int = 1) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `vocab_size` ids: bos/eos specials at their ids, the
    256 byte symbols, then two-symbol tokens (with their merges) until the size is reached."""
    specials = {bos_id: "<｜begin▁of▁sentence｜>", eos_id: "<｜end▁of▁sentence｜>"}
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 byte symbols + bos/eos")
    symbols = list(_bytes_to_unicode().values())
    free = (i for i in range(vocab_size) if i not in specials)
    vocab: dict[str, int] = {tok: i for i, tok in specials.items()}
    for s in symbols:
        vocab[s] = next(free)
    merges: list[tuple[str, str]] = []
    rest = list(free)
    pairs = ((a, b) for a in symbols for b in symbols)
    for i in rest:
        a, b = next(pairs)
        vocab[a + b] = i
        merges.append((a, b))
    return vocab, merges


def write_tokenizer(directory: Path, vocab_size: int, bos_id: int = 0, eos_id: int = 1) -> None:
    """tokenizer.json + tokenizer_config.json of `tokenizer_vocab` (what transformers' AutoTokenizer
    and the converter read)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab, merges = tokenizer_vocab(vocab_size, bos_id, eos_id)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    inv = {i: t for t, i in vocab.items()}
    tok.add_special_tokens([AddedToken(inv[bos_id], special=True, normalized=False),
                            AddedToken(inv[eos_id], special=True, normalized=False)])
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"generated tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": inv[bos_id], "eos_token": inv[eos_id],
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20}, indent=2))


def gguf_source_config(cfg) -> dict[str, Any]:
    """config.json for the converter: the transformers config plus the legacy keys it reads."""
    d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_hf_dict().items()}
    d["compress_ratios"] = [int(r) for r in cfg.compress_ratios]
    d["num_hash_layers"] = sum(1 for t in cfg.mlp_layer_types if t == "hash_moe")
    d["qk_rope_head_dim"] = cfg.qk_rope_head_dim
    d.setdefault("norm_topk_prob", True)
    y = cfg.compress_yarn
    if y is not None:
        d["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": y.factor,
                             "original_max_position_embeddings": y.original_max_position_embeddings,
                             "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}
    return d


def write_gguf_source(checkpoint: Path, dst: Path) -> Path:
    """The directory llama.cpp's converter reads (see the module docstring), from a bench checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..models.deepseek_v4.config import load_config
    from ..models.deepseek_v4.convert import convert
    from ..numerics.quant import quantize_fp4_blocks
    cfg = load_config(checkpoint)
    hash_layers = sum(1 for t in cfg.mlp_layer_types if t == "hash_moe")
    if hash_layers and any(t != "hash_moe" for t in cfg.mlp_layer_types[:hash_layers]):
        raise ValueError("llama.cpp's DeepSeek-V4 path needs the hash-routed layers first")
    off = dst / "official"
    convert(checkpoint, off, "official", quantize=False, dtype=torch.float32, floats=torch.bfloat16,
            progress=False)
    tensors: dict[str, torch.Tensor] = {}
    expert = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    for f in sorted(off.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if expert.match(k):
                q, exps = quantize_fp4_blocks(v.float())
                tensors[k] = q
                tensors[k[: -len(".weight")] + ".scale"] = exps.view(e8m0) if e8m0 is not None else exps
            else:
                tensors[k] = v.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(off)
    (dst / "config.json").write_text(json.dumps(gguf_source_config(cfg), indent=2))
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (tuple, list)) else cfg.eos_token_id
    write_tokenizer(dst, cfg.vocab_size, cfg.bos_token_id, eos)
    return dst


# ---- conversion ------------------------------------------------------------------------------------
# Runs the converter script's own main() after one change: the pre-tokenizer name of the generated
# tokenizer (whose hash the converter cannot know) is fixed. argv: source dir, pre name, converter args.
_DRIVER = """\
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _converter_files(source: Path) -> list[Path]:
    files = [source / "convert_hf_to_gguf.py"]
    for sub in ("conversion/base.py", "conversion/deepseek.py", "gguf-py/gguf/constants.py",
                "gguf-py/gguf/tensor_mapping.py"):
        if (source / sub).is_file():
            files.append(source / sub)
    return files


def gguf_key(checkpoint: Path, source: Path) -> str:
    """Cache key of the GGUF: the checkpoint's bench key, the converter's sources and RECIPE_VERSION."""
    h = hashlib.sha256()
    try:
        h.update(json.loads((checkpoint / "bench-meta.json").read_text()).get("key", "").encode())
    except (OSError, json.JSONDecodeError):
        h.update(str((checkpoint / "model.safetensors").stat().st_mtime_ns).encode())
    h.update(f"recipe {RECIPE_VERSION}".encode())
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


def ensure_gguf(checkpoint: str | os.PathLike, llama: LlamaCpp, *, time_limit: float = 900.0,
                log: Callable[[str], None] | None = None, python: str | None = None) -> Gguf:
    """The GGUF of the bench checkpoint for `llama`'s converter, written on first use into
    `<checkpoint>/llama.cpp/` and reused while its key matches. Never raises for a failed
    conversion: `problem` says what went wrong (the converter's last error line)."""
    log = log or (lambda m: None)
    checkpoint = Path(checkpoint)
    if llama.source is None:
        return Gguf(None, problem=llama.problem or "no llama.cpp converter")
    try:
        key = gguf_key(checkpoint, llama.source)
    except OSError as e:
        return Gguf(None, problem=f"conversion failed: {e}")
    cache = checkpoint / "llama.cpp"
    target = cache / f"model-{key}.gguf"
    if target.is_file():
        return Gguf(target, cached=True)
    log(f"converting {checkpoint} to GGUF with {llama.converter}")
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob("model-*.gguf"):  # an older key: rebuilt below
        old.unlink()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".gguf-src-", dir=cache))
    try:
        try:
            write_gguf_source(checkpoint, work / "src")
        except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
            return Gguf(None, problem=f"conversion failed: GGUF source: {type(e).__name__}: {e}"[:400])
        out = work / "model.gguf"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(llama.source / "gguf-py")] + (
            [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        cmd = [python or sys.executable, "-c", _DRIVER, str(llama.source), PRE_TOKENIZER,
               str(work / "src"), "--outfile", str(out), "--outtype", GGUF_OUTTYPE]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=time_limit)
        except subprocess.TimeoutExpired:
            return Gguf(None, problem=f"conversion failed: converter still running after {time_limit:g} s")
        log_text = (proc.stdout or "") + (proc.stderr or "")
        if proc.returncode != 0 or not out.is_file():
            return Gguf(None, problem=_conversion_problem(log_text, proc.returncode), detail=log_text[-4000:])
        os.replace(out, target)
        (cache / f"model-{key}.json").write_text(json.dumps({
            "key": key, "recipe": RECIPE_VERSION, "converter": str(llama.converter),
            "pre_tokenizer": PRE_TOKENIZER, "command": cmd[:2] + ["<driver>"] + cmd[3:]}, indent=2))
        return Gguf(target, convert_s=time.perf_counter() - t0)
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


def _is_oom_text(text: str) -> bool:
    t = text.lower()
    return any(s in t for s in ("bad_alloc", "failed to allocate", "cannot allocate memory", "out of memory",
                                "unable to allocate"))


# Runs argv[1:] as a child and reports its ru_maxrss. Needed because Linux carries a process's peak RSS
# across execve: a program started straight from this (large) Python process would report at least this
# process's RSS. Forked from this small `python -S` instead, the floor is ~9 MiB.
_MAXRSS_MARK = "@@kvfold-llama-maxrss "
_RSS_WRAPPER = """import os, signal, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write("cannot run %s: %s\\n" % (sys.argv[1], e))
    os._exit(127)
_, status, ru = os.wait4(pid, 0)
sys.stderr.write("\\n%s%d\\n" % (MARK, ru.ru_maxrss * 1024))
sys.stderr.flush()
code = os.waitstatus_to_exitcode(status)
if code < 0:  # die of the same signal
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), -code)
sys.exit(code)
""".replace("MARK", repr(_MAXRSS_MARK))


def _run_limited(cmd: list[str], time_limit: float, mem_limit_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    """Run `cmd` in its own process group under RLIMIT_DATA and a wall-clock limit; returns its output,
    return code (negative = signal), peak RSS (ru_maxrss of `cmd`'s process, see _RSS_WRAPPER; None when
    it was killed) and wall time."""
    from .cell import _set_mem_limit

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen([sys.executable, "-S", "-c", _RSS_WRAPPER, *cmd], stdout=out, stderr=err, text=True, env=env, start_new_session=True,
                                    preexec_fn=lambda: _set_mem_limit(mem_limit_bytes))
        except OSError as e:
            return {"returncode": None, "stdout": "", "stderr": str(e), "timed_out": False, "wall_s": 0.0,
                    "maxrss": None, "start_error": f"{type(e).__name__}: {e}"}
        timed_out, status, usage = False, None, None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > time_limit:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stderr, maxrss = [], None
        for line in err.read().splitlines(keepends=True):
            if line.startswith(_MAXRSS_MARK):
                maxrss = int(line[len(_MAXRSS_MARK):])
            else:
                stderr.append(line)
        return {"returncode": proc.returncode, "stdout": out.read(), "stderr": "".join(stderr).rstrip("\n"),
                "timed_out": timed_out, "wall_s": wall, "maxrss": maxrss}


LLAMA_REPETITIONS = 3  # timed repetitions per llama-bench test; --llama-bench-args "-r N" overrides


def llama_bench_command(llama: LlamaCpp, gguf: Path, *, prompt: int, gen: int, depth: int, threads: int,
                        extra: list[str] | None = None) -> list[str]:
    return [str(llama.bench), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
            "-t", str(threads), "-r", str(LLAMA_REPETITIONS), "-o", "jsonl", *(extra or [])]


def _failure(run: dict[str, Any], what: str) -> str:
    if run.get("start_error"):
        return f"error: cannot start llama-bench: {run['start_error']}"
    if run["timed_out"]:
        return SKIP_TIME
    rc, err = run["returncode"], run["stderr"] or ""
    if _is_oom_text(err) or (rc is not None and rc < 0 and -rc in (signal.SIGKILL,)):
        return OOM
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or "exception" in ln.lower() or "failed" in ln.lower()]
    tail = (errs or lines or [f"exit code {rc}"])[-1]
    return f"error: llama-bench {what}: {tail}"[:300]


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


def _finish_record(rec: dict[str, Any], status: str, detail: str, t0: float, psi0: int | None,
                   pressure: Callable[[], int | None] | None) -> dict[str, Any]:
    """Close a llama.cpp cell record: its status, wall time, CPU pressure and (failed) error detail."""
    rec["status"] = status
    rec["wall_s"] = time.perf_counter() - t0
    psi1 = pressure() if pressure else None
    rec["cpu_pressure_some"] = ((psi1 - psi0) / 1e6 / rec["wall_s"]) if (
        psi0 is not None and psi1 is not None and rec["wall_s"] > 0) else None
    if status != "ok":
        rec["error_detail"] = detail[-2000:]
    return rec


def run_cell(llama: LlamaCpp, gguf: Path, context: int, *, decode_tokens: int, threads: int,
             time_limit: float, mem_limit_bytes: int = 0, env: dict[str, str] | None = None,
             pressure: Callable[[], int | None] | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    """One llama.cpp cell as a record of the bench's JSON (the keys kvfold's cells have where
    llama-bench measures the same thing). Never raises."""
    env = dict(os.environ if env is None else env)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    psi0 = pressure() if pressure else None
    rec: dict[str, Any] = {"engine": ENGINE, "context": context, "loadavg_1m_at_start": load0,
                           "mem_limit_bytes": int(mem_limit_bytes), "commands": []}
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


def unavailable_record(context: int, why: str) -> dict[str, Any]:
    status = f"{UNAVAILABLE}: {why}"
    return {"engine": ENGINE, "context": context, "status": status, "prefill_status": status,
            "decode_status": status, "not_run": True}
