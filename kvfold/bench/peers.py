"""What the peer engines of `kvfold bench --vs` (llama.cpp, flyweight) share: running a peer's
program in a fresh process under the cell's limits, its peak RSS, and the records of cells that
could not run.

A peer's program runs under a tiny `python -S` wrapper (`_RSS_WRAPPER`) in its own process group,
with RLIMIT_DATA at the cell's memory cap (heap and anonymous mappings; a memory-mapped GGUF does
not count) and killed at the cell's time limit. The wrapper forks the program and reports its
ru_maxrss: Linux carries a process's peak RSS across execve, so a program started straight from
the (large) bench process would report at least the bench's RSS; forked from the small wrapper,
the floor is ~9 MiB. A program that must be talked to while it runs (flyweight's server) is
started with `start_limited` and stopped with `Limited.stop`; one that just runs to its end
(llama-bench) with `run_limited`.

Importing this module is cheap (no torch).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .protocol import OOM, SKIP_TIME

UNAVAILABLE = "unavailable"

_MAXRSS_MARK = "@@kvfold-peer-maxrss "
_RSS_WRAPPER = """import os, signal, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write("cannot run %s: %s\\n" % (sys.argv[1], e))
    os._exit(127)
for s in (signal.SIGTERM, signal.SIGINT):  # stopping the wrapper stops the program, then reports
    signal.signal(s, lambda n, f: os.kill(pid, n))
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


class Limited:
    """A peer program running under the wrapper: its output goes to temporary files, read back by
    `result()` once it ended."""

    def __init__(self, cmd: list[str], mem_limit_bytes: int, env: dict[str, str]):
        # imported here, before the fork (not in the child), and not at module level: `python -m
        # kvfold.bench.cell` imports this package first, and must not find cell.py imported already
        from .cell import _set_mem_limit
        self.t0 = time.perf_counter()
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.timed_out = False
        self.status: int | None = None
        self.start_error: str | None = None
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-S", "-c", _RSS_WRAPPER, *cmd], stdout=self._out, stderr=self._err, text=True,
                env=env, start_new_session=True, preexec_fn=lambda: _set_mem_limit(mem_limit_bytes))
        except OSError as e:
            self.proc = None
            self.start_error = f"{type(e).__name__}: {e}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> bool:
        """Whether the program has ended (reaped here: Popen must not wait again)."""
        if self.proc is None or self.status is not None:
            return True
        pid, status, _ = os.wait4(self.proc.pid, os.WNOHANG)
        if pid:
            self.status = status
            self.proc.returncode = os.waitstatus_to_exitcode(status)
        return bool(pid)

    def wait(self, deadline: float) -> bool:
        """Wait until it ends or perf_counter() reaches `deadline` (then it is killed); True if it ended
        by itself."""
        while not self.poll():
            if time.perf_counter() >= deadline:
                self.timed_out = True
                self.kill()
                return False
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        """SIGKILL the whole process group (no peak RSS is reported then)."""
        if self.proc is None or self.status is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.status = os.wait4(self.proc.pid, 0)[1]
        self.proc.returncode = os.waitstatus_to_exitcode(self.status)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the program (the wrapper then reports its peak RSS); SIGKILL after `grace` s."""
        if self.proc is None or self.poll():
            return
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.perf_counter() + grace
        while not self.poll():
            if time.perf_counter() >= end:
                self.kill()
                return
            time.sleep(0.05)

    def result(self) -> dict[str, Any]:
        """Output, return code (negative = signal), peak RSS (None when killed) and wall time."""
        if self.proc is None:
            return {"returncode": None, "stdout": "", "stderr": self.start_error or "", "timed_out": False,
                    "wall_s": 0.0, "maxrss": None, "start_error": self.start_error}
        wall = time.perf_counter() - self.t0
        self._out.seek(0)
        self._err.seek(0)
        stderr, maxrss = [], None
        for line in self._err.read().splitlines(keepends=True):
            if line.startswith(_MAXRSS_MARK):
                maxrss = int(line[len(_MAXRSS_MARK):])
            else:
                stderr.append(line)
        res = {"returncode": self.proc.returncode, "stdout": self._out.read(),
               "stderr": "".join(stderr).rstrip("\n"), "timed_out": self.timed_out, "wall_s": wall, "maxrss": maxrss}
        self._out.close()
        self._err.close()
        return res


def start_limited(cmd: list[str], mem_limit_bytes: int, env: dict[str, str]) -> Limited:
    return Limited(cmd, mem_limit_bytes, env)


def run_limited(cmd: list[str], time_limit: float, mem_limit_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    """Run `cmd` to its end under the cell's limits: its output, return code, peak RSS and wall time."""
    p = start_limited(cmd, mem_limit_bytes, env)
    if p.proc is not None:
        p.wait(p.t0 + time_limit)
    return p.result()


def program_pid(wrapper_pid: int) -> int | None:
    """The program the wrapper forked (its only child), from /proc; None if not found."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # the fields after the command name (which may hold spaces) start with the state, then ppid
        if int(stat.rsplit(")", 1)[1].split()[1]) == wrapper_pid:
            return int(d.name)
    return None


def vm_hwm(pid: int | None) -> int | None:
    """A process's peak RSS so far (VmHWM), bytes; None if unreadable."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def is_oom_text(text: str) -> bool:
    t = text.lower()
    return any(s in t for s in ("bad_alloc", "failed to allocate", "cannot allocate memory", "out of memory",
                                "unable to allocate", "memoryerror"))


def failure_status(run: dict[str, Any], program: str, what: str) -> str:
    """Why a peer program's run gave no numbers: SKIP_TIME, OOM or `error: <program> <what>: <line>`."""
    if run.get("start_error"):
        return f"error: cannot start {program}: {run['start_error']}"
    if run["timed_out"]:
        return SKIP_TIME
    rc, err = run["returncode"], run["stderr"] or ""
    if is_oom_text(err) or (rc is not None and rc < 0 and -rc == signal.SIGKILL):
        return OOM
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or "exception" in ln.lower() or "failed" in ln.lower()]
    tail = (errs or lines or [f"exit code {rc}"])[-1]
    return f"error: {program} {what}: {tail}"[:300]


def new_record(engine: str, context: int, mem_limit_bytes: int) -> dict[str, Any]:
    return {"engine": engine, "context": context,
            "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "mem_limit_bytes": int(mem_limit_bytes), "commands": []}


def finish_record(rec: dict[str, Any], status: str, detail: str, t0: float, psi0: int | None,
                  pressure: Callable[[], int | None] | None) -> dict[str, Any]:
    """Close a peer cell record: its status, wall time, CPU pressure and (failed) error detail."""
    rec["status"] = status
    rec["wall_s"] = time.perf_counter() - t0
    psi1 = pressure() if pressure else None
    rec["cpu_pressure_some"] = ((psi1 - psi0) / 1e6 / rec["wall_s"]) if (
        psi0 is not None and psi1 is not None and rec["wall_s"] > 0) else None
    if status != "ok":
        rec["error_detail"] = detail[-2000:]
    return rec


def unavailable_record(engine: str, context: int, why: str) -> dict[str, Any]:
    """The cell of a peer that cannot run at all (not installed, no GGUF, a model it cannot run)."""
    status = f"{UNAVAILABLE}: {why}"
    return {"engine": engine, "context": context, "status": status, "prefill_status": status,
            "decode_status": status, "not_run": True}


def dsv4_problem(checkpoint: str | os.PathLike) -> str | None:
    """None if `checkpoint` is a DeepSeek-V4 checkpoint (the one model the peers' GGUF path knows),
    else why not, for the peers' unavailable cells."""
    import json
    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"cannot read the checkpoint's config.json: {e}"
    arch = cfg.get("architectures") or [cfg.get("model_type")]
    if "DeepseekV4ForCausalLM" in arch or ("compress_ratios" in cfg and "hc_mult" in cfg):
        return None
    return f"the peers' GGUF path converts DeepSeek-V4 checkpoints only, not {', '.join(map(str, arch))}"
