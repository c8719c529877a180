"""One `kvfold bench` cell in a fresh `python -m kvfold.bench.cell` process: its command, its
environment (the same thread count for every engine), its time limit (the process group is
killed), its CPU pressure, and the JSON record made of what it reported.

Importing this module is cheap (no torch).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .protocol import MARK, OOM, SKIP_TIME, SYNTHETIC

def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_pressure_us() -> int | None:
    """Total microseconds some runnable task waited for a CPU (Linux PSI), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.split("total=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return None


def child_env(threads: int) -> dict[str, str]:
    """The environment of a bench subprocess: this kvfold first on the path, `threads` threads per library."""
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # the directory holding `kvfold/`
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(threads)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cell_command(mode: str, *, checkpoint: str | None, context: int, decode_tokens: int, threads: int, seed: int,
                  warmup: int, mem_limit_bytes: int, prefill_logits: str, extra: list[str] | None) -> list[str]:
    cmd = [sys.executable, "-m", "kvfold.bench.cell", "--mode", mode, "--threads", str(threads),
           "--seed", str(seed), "--warmup", str(warmup), "--context", str(context),
           "--decode-tokens", str(decode_tokens), "--mem-limit-bytes", str(int(mem_limit_bytes)),
           "--prefill-logits", prefill_logits]
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint)]
    return cmd + list(extra or [])


def _communicate(proc: subprocess.Popen, time_limit: float) -> tuple[str, str, bool]:
    """(stdout, stderr, timed_out) of `proc`; past `time_limit` its process group is killed."""
    try:
        out, err = proc.communicate(timeout=time_limit)
        return out, err, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the cell's own process group (start_new_session)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return out, err, True


def _parse_phases(out: str | None) -> dict[str, Any]:
    """The cell's reports (protocol.MARK lines), by phase."""
    phases: dict[str, Any] = {}
    for line in (out or "").splitlines():
        if line.startswith(MARK):
            try:
                d = json.loads(line[len(MARK):])
            except json.JSONDecodeError:
                continue
            phases[d.pop("phase", "?")] = d
    return phases


def _cell_status(res: dict[str, Any], timed_out: bool, returncode: int | None, err: str | None) -> None:
    """Set res["status"] (and res["signal"] for a killed cell) from how the cell process ended."""
    phases = res["phases"]
    if timed_out:
        res["status"] = SKIP_TIME
    elif "done" in phases and returncode == 0:
        res["status"] = "ok"
    elif "error" in phases:
        e = phases["error"]
        res["status"] = OOM if e.get("oom") else "error: " + e.get("error", "?").splitlines()[0][:300]
    elif returncode is not None and returncode < 0 and -returncode in (signal.SIGKILL, signal.SIGABRT):
        # killed by the kernel's OOM killer, or a C++ bad_alloc abort under the data cap
        res["status"] = OOM
        res["signal"] = -returncode
    else:
        tail = (err or "").strip().splitlines()[-1:] or [f"exit code {returncode}"]
        res["status"] = "error: " + tail[0][:300]


def run_subprocess_cell(mode: str, *, checkpoint: str | None = None, context: int = 0, decode_tokens: int = 0,
                        threads: int = 2, seed: int = 0, warmup: int = 0, time_limit: float = 300.0,
                        mem_limit_bytes: int = 0, prefill_logits: str = "all",
                        extra: list[str] | None = None) -> dict[str, Any]:
    """Run one cell in a fresh process. Returns {"status": "ok" | SKIP_TIME | OOM | "error: ...",
    "phases": {phase: data}, "wall_s", ...}; never raises for a failing cell."""
    cmd = _cell_command(mode, checkpoint=checkpoint, context=context, decode_tokens=decode_tokens, threads=threads,
                        seed=seed, warmup=warmup, mem_limit_bytes=mem_limit_bytes, prefill_logits=prefill_logits,
                        extra=extra)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    psi0 = _cpu_pressure_us()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(threads), start_new_session=True)
    out, err, timed_out = _communicate(proc, time_limit)
    wall = time.perf_counter() - t0
    psi1 = _cpu_pressure_us()
    res: dict[str, Any] = {"wall_s": wall, "returncode": proc.returncode, "phases": _parse_phases(out),
                           "loadavg_1m_at_start": load0, "mem_limit_bytes": int(mem_limit_bytes),
                           # share of the cell's wall time in which some task waited for a CPU: a
                           # high value means other work competed for the cores during the cell
                           "cpu_pressure_some": ((psi1 - psi0) / 1e6 / wall) if psi0 is not None and psi1 is not None
                           and wall > 0 else None}
    _cell_status(res, timed_out, proc.returncode, err)
    if res["status"] != "ok":
        res["stderr_tail"] = (err or "")[-3000:]
    return res


def _cell_record(engine: str, context: int, raw: dict[str, Any]) -> dict[str, Any]:
    """Flatten a subprocess result into one cell record of the JSON output."""
    ph = raw.get("phases", {})
    loaded, pre, done = ph.get("loaded", {}), ph.get("prefill", {}), ph.get("done", {})
    rec: dict[str, Any] = {"engine": engine, "context": context, "status": raw["status"], "wall_s": raw["wall_s"],
                           "loadavg_1m_at_start": raw.get("loadavg_1m_at_start"),
                           "cpu_pressure_some": raw.get("cpu_pressure_some"),
                           "mem_limit_bytes": raw.get("mem_limit_bytes")}
    rec["import_s"] = loaded.get("import_s")
    rec["load_s"] = loaded.get("load_s")
    rec["load_peak_rss_bytes"] = loaded.get("load_peak_rss")
    rec["rss_after_load_bytes"] = loaded.get("rss_after_load")
    if loaded.get("weight_bytes"):
        rec["weight_bytes"], rec["parameters"] = loaded["weight_bytes"], loaded["parameters"]
    if pre:
        # --context-fill synthetic: the state was filled, not prefilled (synthetic_context.py)
        rec["prefill_status"] = "ok" if pre.get("prefill_s") is not None else SYNTHETIC
        rec["context_fill"] = pre.get("context_fill", "prefill")
        rec["prefill_s"] = pre["prefill_s"]
        rec["prefill_tok_s"] = pre["prefill_tok_s"]
        rec["prefill_samples_s"] = pre.get("prefill_samples_s")
        rec["rss_before_prefill_bytes"] = pre["rss_before_prefill"]
        rec["prefill_peak_rss_bytes"] = pre["prefill_peak_rss"]
        rec["prefill_peak_over_loaded_bytes"] = (pre["prefill_peak_rss"] - pre["rss_before_prefill"]
                                                 if pre.get("rss_before_prefill") is not None else None)
        rec["peak_rss_reset_ok"] = pre.get("peak_reset")
        rec["state_bytes_after_prefill"] = pre.get("state_bytes_after_prefill")
    else:
        rec["prefill_status"] = raw["status"]
    if done:
        rec["decode_status"] = "ok"
        for k in ("decode_tokens", "decode_s", "decode_tok_s", "decode_step_median_s", "decode_step_min_s",
                  "decode_step_p10_s", "decode_step_p90_s", "decode_tok_s_median", "state_bytes_after_decode"):
            rec[k] = done.get(k)
        rec["decode_peak_rss_bytes"] = done.get("decode_peak_rss")
        rec["ru_maxrss_bytes"] = done.get("ru_maxrss")
        rec["tokens"] = done.get("tokens")
    else:
        rec["decode_status"] = raw["status"] if pre or raw["status"] != "ok" else "missing"
    if raw["status"] != "ok":
        if pre:  # the prefill finished before the cell failed: keep its numbers
            rec["status"] = "partial: decode " + raw["status"]
        rec["error_detail"] = (ph.get("error", {}).get("traceback") or raw.get("stderr_tail") or "")[-2000:]
    return rec


def _cell_message(rec: dict[str, Any]) -> str:
    msg = f"{rec['engine']} @ {rec['context']}: {rec['status']} in {rec['wall_s']:.1f} s"
    if rec.get("prefill_tok_s"):
        msg += f", prefill {rec['prefill_tok_s']:.1f} tok/s"
    if rec.get("decode_tok_s"):
        msg += f", decode {rec['decode_tok_s']:.1f} tok/s"
    return msg
