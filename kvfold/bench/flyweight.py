"""`kvfold bench --vs flyweight`: the same random checkpoint run by flyweight-llm's DeepSeek-V4 CPU path.

flyweight (PyPI `flyweight-llm`, in the `bench` extra; Linux x86-64 and Windows wheels) is a C++
engine that reads the GGUF llama.cpp's converter writes, so a flyweight cell runs on the llama.cpp
engine's GGUF (the first of `--llama-outtype`): `--vs flyweight` needs `--llama-cpp` for the
converter. The CLI is found as `--flyweight PATH` (the program or a directory holding it, e.g. a
venv's bin/), `$KVFOLD_FLYWEIGHT`, next to this Python, or on PATH.

How a cell is timed, and why this way. flyweight's `benchmark` command refuses DeepSeek-V4 files,
and `generate` prints text only: timing two `generate` runs (N and N + D new tokens) would take the
decode time as the difference of two whole-process times, each with a load of the model (seconds,
varying with the page cache), a tokenization and a prefill of their own, so D tokens' time would be
a small difference of two large, noisy numbers; and a random model may stop at its end token. The
cell therefore runs `flyweight serve MODEL --backend cpu` once, in a fresh process under the cell's
time and memory limits (peers.py), and reads the timings off its OpenAI-compatible stream, where
flyweight reports them itself:

* prefill: a chat request with `"prefill_progress": true` makes the server send a frame when the
  prompt is admitted (before any of it is evaluated) and one when its last token is evaluated;
  prefill s = the time between the two frames' arrivals (no load, tokenization or HTTP set-up in
  it), over the prompt tokens the frames count (`total` - `cached`, and cached is 0 here);
* decode: every streamed token chunk carries the server's own `generated_tokens` and
  `decode_elapsed_seconds` (since the first generated token), measured in the server as it emits
  them: decode tok/s = (generated_tokens - 1) / decode_elapsed_seconds of the last chunk (its
  single-token steps after the prompt, i.e. at depth CONTEXT, as llama-bench's `-d CONTEXT`). It
  includes what flyweight's serving decode does per token (greedy sampling, detokenizing), not load
  or prefill, and does not depend on how many tokens a text chunk holds.

The prompt: random text (printable ASCII, 2-byte and CJK characters, so the byte-level tokens span
~190 distinct ids and every expert of the hash-routed layers is reached, as random ids reach them
in kvfold's and llama.cpp's cells), fitted with the server's `/tokenize` so that the chat-templated
prompt has CONTEXT tokens (the template's own tokens are measured on the warm-up request); the
count the server reports is what the numbers use (`prompt_tokens`). Each request's text is new, so
no prefix is reused. Settings: `--backend cpu`, one sequence slot (`--parallel 1`; its DeepSeek-V4
runtime refuses a prompt cache), its default f16 KV cache (as llama-bench's), the context window
CONTEXT + DECODE + 256; threads: OMP_NUM_THREADS and FLYWEIGHT_CPU_THREADS = `--threads` (its
`--cpu-threads` flag is refused for DeepSeek-V4). Its server prefills in chunks of 32 tokens (its
scheduler's own choice, which serving gets too). Warm-up: one request of `--warmup` tokens (1 with
`--warmup 0`: it also measures the template) and 2 new ones; then
FLYWEIGHT_REPETITIONS requests of CONTEXT tokens and DECODE + 1 new ones, their median reported
(as llama-bench's `-r 3`). Prefill peak RSS = the server's VmHWM when the first timed prefill ended
(load, warm-up and that prefill; the GGUF is memory-mapped, so touched weight pages count); the
whole process's ru_maxrss is `ru_maxrss_bytes`.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from . import peers as P
from .protocol import SKIP_TIME

ENGINE = "flyweight"
ENV_VAR = "KVFOLD_FLYWEIGHT"
PACKAGE = "flyweight-llm==0.23.1"  # the version the bench was written against (the `bench` extra's)
FLYWEIGHT_REPETITIONS = 3
CONTEXT_MARGIN = 256  # context window beyond CONTEXT + DECODE: the chat template's tokens


# ---- finding flyweight ------------------------------------------------------------------------------
@dataclass
class Flyweight:
    """The CLI that was found (None and `problem` when not), and its version."""
    cli: Path | None
    version: str | None = None
    problem: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"cli": str(self.cli) if self.cli else None, "version": self.version, "problem": self.problem}


def _candidates(given: str | os.PathLike | None) -> list[Path]:
    if given is not None:
        p = Path(given).expanduser()
        return [p / "flyweight", p / "bin" / "flyweight"] if p.is_dir() else [p]
    env = os.environ.get(ENV_VAR)
    if env:
        return _candidates(env)
    found = [Path(sys.executable).parent / "flyweight"]
    which = shutil.which("flyweight")
    return found + ([Path(which)] if which else [])


def locate(given: str | os.PathLike | None = None) -> Flyweight:
    """Find the `flyweight` CLI (see the module docstring) and ask its version; never raises."""
    for p in _candidates(given):
        if p.is_file() and os.access(p, os.X_OK):
            try:
                out = subprocess.run([str(p), "--version"], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:
                return Flyweight(p, problem=f"{p} --version failed: {type(e).__name__}: {e}")
            if out.returncode != 0:
                tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit code {out.returncode}"]
                return Flyweight(p, problem=f"{p} --version failed: {tail[0]}"[:300])
            return Flyweight(p.resolve(), version=out.stdout.strip().split()[-1] if out.stdout.strip() else None)
    where = f"--flyweight {given}" if given is not None else f"${ENV_VAR}, {Path(sys.executable).parent} or PATH"
    return Flyweight(None, problem=f"no flyweight CLI in {where} (pip install '{PACKAGE}', part of "
                                   "pip install 'kvfold[bench]' on Linux x86-64)")


# ---- the server and its requests ------------------------------------------------------------------
def serve_command(fw: Flyweight, gguf: Path, *, port: int, context_window: int) -> list[str]:
    return [str(fw.cli), "serve", str(gguf), "--backend", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--context", str(context_window), "--parallel", "1"]


def server_env(env: dict[str, str], threads: int) -> dict[str, str]:
    env = dict(env)
    env["OMP_NUM_THREADS"] = env["FLYWEIGHT_CPU_THREADS"] = str(threads)
    env["NO_COLOR"] = "1"
    return env


def chat_payload(text: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "prefill_progress": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, payload: dict[str, Any], timeout: float) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(timeout, 1.0))
    conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    return conn.getresponse()


class ServerError(Exception):
    """A request the server refused or broke off (its message goes into the cell's status)."""


def _read_json(resp: http.client.HTTPResponse) -> dict[str, Any]:
    body = resp.read()
    if resp.status != 200:
        raise ServerError(f"HTTP {resp.status}: {body[:300].decode(errors='replace')}")
    return json.loads(body)


def sse_lines(resp: http.client.HTTPResponse, deadline: float = float("inf")) -> Iterable[tuple[float, str]]:
    """(arrival time, payload) of each `data:` line of a server-sent event stream; TimeoutError once
    perf_counter() passes `deadline`."""
    while True:
        if time.perf_counter() > deadline:
            raise TimeoutError("the cell's time limit passed during a request")
        line = resp.readline()
        if not line:
            return
        t = time.perf_counter()
        text = line.decode("utf-8", errors="replace").strip()
        if text.startswith("data:"):
            yield t, text[5:].strip()


# ---- timings from a stream ------------------------------------------------------------------------
@dataclass
class StreamTiming:
    """What one streamed request measured (see the module docstring)."""
    prompt_tokens: int | None = None
    cached: int = 0
    prefill_start: float | None = None  # arrival of the admission frame
    prefill_end: float | None = None    # arrival of the frame with processed == total
    generated: int = 0                  # the server's generated_tokens, last seen
    decode_elapsed: float | None = None  # its decode_elapsed_seconds, last seen
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def prefill_s(self) -> float | None:
        if self.prefill_start is None or self.prefill_end is None:
            return None
        return self.prefill_end - self.prefill_start

    @property
    def prefill_tokens(self) -> int | None:
        return None if self.prompt_tokens is None else self.prompt_tokens - self.cached

    @property
    def decode_steps(self) -> int:
        return max(self.generated - 1, 0)  # the first token comes out of the prefill

    @property
    def decode_s(self) -> float | None:
        return self.decode_elapsed if self.decode_steps and self.decode_elapsed else None


def _prefill_frame(st: StreamTiming, t: float, frame: dict[str, Any],
                   on_prefill_end: Callable[[], None] | None) -> None:
    total, done = int(frame.get("total", 0)), int(frame.get("processed", 0))
    if st.prefill_start is None:
        st.prefill_start, st.prompt_tokens, st.cached = t, total, int(frame.get("cached", 0))
    if done >= total and st.prefill_end is None:
        st.prefill_end = t
        if on_prefill_end is not None:
            on_prefill_end()


def parse_stream(lines: Iterable[tuple[float, str]],
                 on_prefill_end: Callable[[], None] | None = None) -> StreamTiming:
    """The timings of a chat stream with prefill_progress on (see the module docstring)."""
    st = StreamTiming()
    for t, data in lines:
        if data == "[DONE]":
            break
        try:
            ev = json.loads(data)
        except json.JSONDecodeError:
            continue
        if "error" in ev:
            err = ev["error"]
            st.errors.append(str(err.get("message", err) if isinstance(err, dict) else err))
        fw = ev.get("flyweight") or {}
        if isinstance(fw.get("prefill"), dict):
            _prefill_frame(st, t, fw["prefill"], on_prefill_end)
        if "generated_tokens" in fw and fw.get("decode_elapsed_seconds") is not None:
            st.generated, st.decode_elapsed = int(fw["generated_tokens"]), float(fw["decode_elapsed_seconds"])
        for ch in ev.get("choices") or []:
            st.finish_reason = ch.get("finish_reason") or st.finish_reason
    return st


def summarize_reps(reps: list[StreamTiming]) -> dict[str, Any]:
    """The cell's numbers from its timed requests: medians of prefill and decode tok/s, and the samples."""
    out: dict[str, Any] = {}
    pre = [(r.prefill_tokens, r.prefill_s) for r in reps if r.prefill_s and r.prefill_tokens]
    if pre:
        rates = sorted(n / s for n, s in pre)
        out.update(prefill_status="ok", prefill_tok_s=statistics.median(rates),
                   prefill_samples_tok_s=[n / s for n, s in pre], prompt_tokens=pre[0][0],
                   prefill_s=pre[0][0] / statistics.median(rates))
    dec = [(r.decode_steps, r.decode_s) for r in reps if r.decode_s]
    if dec:
        rates = [n / s for n, s in dec]
        med = statistics.median(rates)
        out.update(decode_status="ok", decode_tok_s=med, decode_tokens=dec[0][0], decode_s=dec[0][0] / med,
                   decode_samples_tok_s=rates)
    return out


# ---- the prompt -----------------------------------------------------------------------------------
_POOL = ([chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xA1, 0x800)]
         + [chr(c) for c in range(0x4E00, 0x4E00 + 512)])


def random_text(n_chars: int, seed: int) -> str:
    """Words of random characters from _POOL (see the module docstring), `n_chars` long."""
    rnd = random.Random(seed)
    chars = []
    while len(chars) < n_chars:
        chars += [rnd.choice(_POOL) for _ in range(rnd.randint(1, 8))] + [" "]
    return "".join(chars[:n_chars])


def fit_text(count: Callable[[str], int], target: int, seed: int) -> str:
    """The longest prefix of a random text whose token count (`count`, the server's /tokenize) is at
    most `target` (at least one character): a binary search over the prefix length, then one-byte
    characters while a multi-byte one left it short."""
    text = random_text(max(target, 1) * 2, seed)
    for _ in range(8):  # tokens of more than two characters: longer (the same prefix, the same seed)
        if count(text) >= target:
            break
        text = random_text(len(text) * 2, seed)
    lo, hi = 1, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = text[:lo]
    for _ in range(4):
        n = count(text)
        if n >= target or count(text + "x") > target:
            break
        text += "x"
    return text


# ---- one cell -------------------------------------------------------------------------------------
class _Session:
    """One cell's server process, its port and the cell's deadline."""

    def __init__(self, proc: P.Limited, port: int, deadline: float):
        self.proc, self.port, self.deadline = proc, port, deadline
        self.program: int | None = None

    def left(self) -> float:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError("the cell's time limit passed")
        return left

    def wait_ready(self) -> bool:
        """Poll /health until the model is loaded (True), or the server ended or time ran out (False)."""
        while not self.proc.poll() and time.perf_counter() < self.deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    self.program = P.program_pid(self.proc.pid)
                    return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def tokens(self, text: str) -> int:
        return int(_read_json(_post(self.port, "/tokenize", {"content": text}, self.left()))["count"])

    def chat(self, text: str, max_tokens: int, on_prefill_end: Callable[[], None] | None = None) -> StreamTiming:
        resp = _post(self.port, "/v1/chat/completions", chat_payload(text, max_tokens), self.left())
        if resp.status != 200:
            _read_json(resp)  # raises ServerError with its message
        st = parse_stream(sse_lines(resp, self.deadline), on_prefill_end)
        if st.errors:
            raise ServerError("; ".join(st.errors))
        return st


def _measure(s: _Session, rec: dict[str, Any], reps: list[StreamTiming], context: int, decode_tokens: int,
             warmup: int, seed: int, repetitions: int) -> str | None:
    """Warm-up, then the timed requests (appended to `reps`); None, or why it stopped early."""
    if not s.wait_ready():
        return "the server did not come up"
    rec["load_s"] = time.perf_counter() - s.proc.t0
    warm = fit_text(s.tokens, max(warmup, 1), seed + 1000)  # also measures the chat template's tokens
    w = s.chat(warm, 2 if warmup else 1)
    rec["template_tokens"] = (w.prompt_tokens or 0) - s.tokens(warm)
    target = max(context - rec["template_tokens"], 1)
    for i in range(repetitions):
        text = fit_text(s.tokens, target, seed + i)
        hwm: dict[str, int | None] = {}
        first = (lambda: hwm.setdefault("v", P.vm_hwm(s.program))) if i == 0 else None
        reps.append(s.chat(text, decode_tokens + 1, first))
        if i == 0:
            rec["prefill_peak_rss_bytes"] = hwm.get("v")
    return None


def _why(run: dict[str, Any], problem: str, ended: bool, deadline: float) -> str:
    """The status of a cell that stopped early: the time limit, the server's own exit, or the error."""
    if run["timed_out"] or time.perf_counter() >= deadline:
        return SKIP_TIME
    if ended or run.get("start_error"):
        return P.failure_status(run, "flyweight serve", "exited")
    return f"error: flyweight: {problem}"[:300]


def _close(rec: dict[str, Any], reps: list[StreamTiming], why: str | None, decode_tokens: int) -> str:
    """Fill the record's numbers and statuses from the timed requests; its overall status."""
    rec.update(summarize_reps(reps))
    rec["repetitions"] = len(reps)
    pre, dec = rec.get("prefill_status") == "ok", rec.get("decode_status") == "ok"
    if decode_tokens <= 0 and not dec:
        rec["decode_status"] = "not run (--decode-tokens 0)"
        dec = True
    if why is None:
        if pre and dec:
            return "ok"
        why = "error: flyweight: no timings in its stream"
    rec["stopped_by"] = why
    if not pre:
        rec["prefill_status"] = rec["decode_status"] = why
        return why
    if not dec:
        rec["decode_status"] = why
        return "partial: decode " + why
    return f"partial: {why} (after {len(reps)} timed requests)"


def run_cell(fw: Flyweight, gguf: Path, context: int, *, decode_tokens: int, threads: int, warmup: int,
             time_limit: float, mem_limit_bytes: int = 0, env: dict[str, str] | None = None,
             pressure: Callable[[], int | None] | None = None, seed: int = 0,
             repetitions: int = FLYWEIGHT_REPETITIONS) -> dict[str, Any]:
    """One flyweight cell (a fresh `flyweight serve` process) as a record of the bench's JSON. Never raises."""
    psi0 = pressure() if pressure else None
    rec = P.new_record(ENGINE, context, mem_limit_bytes)
    t0 = time.perf_counter()
    port = _free_port()
    cmd = serve_command(fw, gguf, port=port, context_window=context + decode_tokens + CONTEXT_MARGIN)
    rec["commands"].append(shlex.join(cmd))
    proc = P.start_limited(cmd, mem_limit_bytes, server_env(dict(os.environ if env is None else env), threads))
    s = _Session(proc, port, t0 + time_limit)
    reps: list[StreamTiming] = []
    try:
        problem = _measure(s, rec, reps, context, decode_tokens, warmup, seed, repetitions)
    except (OSError, ServerError, http.client.HTTPException, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    ended = proc.poll()
    if time.perf_counter() >= s.deadline:
        proc.timed_out = True
        proc.kill()
    proc.stop()
    run = proc.result()
    rec["ru_maxrss_bytes"] = rec["decode_peak_rss_bytes"] = run["maxrss"]
    why = _why(run, problem, ended, s.deadline) if problem else None
    status = _close(rec, reps, why, decode_tokens)
    return P.finish_record(rec, status, "\n".join([run["stderr"], run["stdout"]]).strip(), t0, psi0, pressure)


def unavailable_record(context: int, why: str) -> dict[str, Any]:
    return P.unavailable_record(ENGINE, context, why)
