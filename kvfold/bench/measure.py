"""Machine measurements of `kvfold bench` (issue 42 item 3): memory copy and streaming-read
bandwidth, and the time to read a checkpoint's files against the time to load the model from
them, with a cold and a warm page cache.

The bandwidth functions run in a `bandwidth` cell process (torch is imported there, not here);
the page-cache helpers need no root: a file's clean pages are dropped with
posix_fadvise(DONTNEED) and its residency is read with mincore(2) on a fresh mapping (mapping
a file faults nothing in). `run_load_times` is the runner's side: four `loadtime` cells.

Importing this module is cheap (no torch).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from pathlib import Path
from typing import Any, Callable

_MIB = 1 << 20
_GIB = 1 << 30
READ_CHUNK = 16 * _MIB
LOAD_TARGET_RATIO = 1.5  # issue 42: a ready model in at most 1.5x the time to read its files
COLD_RESIDENT_MAX = 0.05  # more still cached after eviction: the "cold" run was not cold


# ---- memory bandwidth ------------------------------------------------------------------------------
def l3_cache_bytes(root: str = "/sys/devices/system/cpu") -> int | None:
    """Total last-level (L3) cache of the machine: every distinct L3 instance once (by the CPUs
    sharing it), from sysfs; else glibc's sysconf; None when neither says."""
    seen: dict[str, int] = {}
    for idx in Path(root).glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (idx / "level").read_text().strip() != "3":
                continue
            size = _size_text((idx / "size").read_text())
            seen[(idx / "shared_cpu_list").read_text().strip()] = size
        except (OSError, ValueError):
            continue
    if seen:
        return sum(seen.values())
    try:
        v = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        return v if v > 0 else None
    except (ValueError, OSError):
        return None


def _size_text(text: str) -> int:
    """sysfs cache sizes: "32768K", "1M", "512"."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": _MIB, "G": _GIB}.get(t[-1:], 1)
    return int(t.rstrip("KMG")) * mult


def read_buffer_bytes(l3: int | None, available: int | None = None) -> int:
    """The streaming-read buffer: 8x the L3 (so at most 1/8 of it can be served from cache), at
    least 1 GiB, at most a quarter of the `available` memory above that, in whole MiB."""
    want = max(8 * (l3 or 0), _GIB)
    if available:
        want = max(min(want, available // 4), _GIB)
    return -(-want // _MIB) * _MIB


def _read_methods():
    import torch
    # Each reads every byte of the fp32 buffer once and writes one scalar. torch's sum of int32,
    # bf16 or int8 views widens every element (to int64 / fp32) and ran at 0.2-1.6 GB/s on a Zen 4
    # (compute-bound, left out); fp32 `sum` (a cascade of adds) ran up to 25% below `amax` / `dot`
    # at 1 and 2 threads. The fastest of the three is taken as the read bandwidth.
    return {"amax": lambda x: x.amax(),  # one max per 16 floats
            "dot": lambda x: torch.dot(x, x),  # BLAS sdot of the buffer with itself: one stream
            "sum": lambda x: x.sum()}


def _best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of `repeats` timed calls after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0], times[len(times) // 2]


def measure_read_bandwidth(nbytes: int | None = None, repeats: int = 5, threads: int | None = None) -> dict:
    """Streaming-read bandwidth: bytes/s of the fastest honest full read of an fp32 buffer far
    larger than the L3 (`read_buffer_bytes`), best of `repeats` after a warm-up, per method."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    l3 = l3_cache_bytes()
    if not nbytes:
        from .spawn import _mem_available
        nbytes = read_buffer_bytes(l3, _mem_available())
    x = torch.empty(nbytes // 4, dtype=torch.float32)
    x.fill_(1.0)  # written, so every page is its own (an untouched one would read the shared zero page)
    methods = {}
    for name, fn in _read_methods().items():
        best, median = _best_of(lambda: fn(x), repeats)
        methods[name] = {"bytes_per_s": x.numel() * 4 / best, "median_bytes_per_s": x.numel() * 4 / median,
                         "best_s": best}
    top = max(methods, key=lambda k: methods[k]["bytes_per_s"])
    return {"bytes_per_s": methods[top]["bytes_per_s"], "median_bytes_per_s": methods[top]["median_bytes_per_s"],
            "method": top, "methods": methods, "buffer_mib": x.numel() * 4 // _MIB, "l3_bytes": l3,
            "repeats": repeats, "threads": torch.get_num_threads()}


def measure_copy_bandwidth(mib: int = 512, repeats: int = 5, threads: int | None = None) -> dict:
    """Best-of-`repeats` `dst.copy_(src)` over an fp32 tensor of `mib` MiB; bytes read + written
    per second."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    n = mib * _MIB // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    best, median = _best_of(lambda: dst.copy_(src), repeats)  # the warm-up touches dst: no page faults timed
    nbytes = 2 * n * 4
    return {"bytes_per_s": nbytes / best, "tensor_mib": mib, "repeats": repeats, "best_s": best,
            "median_bytes_per_s": nbytes / median, "threads": torch.get_num_threads()}


def measure_bandwidth(copy_mib: int = 512, read_mib: int = 0, repeats: int = 5, threads: int | None = None) -> dict:
    """Copy then read bandwidth at the same thread count (the copy's buffers are freed first)."""
    copy = measure_copy_bandwidth(copy_mib, repeats, threads)
    read = measure_read_bandwidth(read_mib * _MIB if read_mib else None, repeats, threads)
    return {"copy": copy, "read": read, "copy_bytes_per_s": copy["bytes_per_s"],
            "read_bytes_per_s": read["bytes_per_s"], "threads": read["threads"]}


# ---- page cache --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _c():
    """libc with mmap / mincore / munmap declared (mincore has no Python wrapper)."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def resident_pages(path: str | Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages of the file), by mincore(2) on a fresh mapping."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    pages = -(-size // page)
    if pages == 0:
        return 0, 0
    lib = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in bytes(vec)), pages


def resident_fraction(paths: list[Path]) -> float:
    """Share of the pages of `paths` in the page cache (1.0 for no pages)."""
    counts = [resident_pages(p) for p in paths]
    total = sum(n for _, n in counts)
    return sum(r for r, _ in counts) / total if total else 1.0


def evict_page_cache(paths: list[Path]) -> None:
    """Drop the cached pages of `paths` (no root needed). Only clean pages go: dirty ones are
    written back first; pages another process has mapped stay (see `resident_fraction`)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sorted."""
    return sorted(Path(directory).glob("*.safetensors"))


def read_files(paths: list[Path], chunk: int = READ_CHUNK) -> tuple[int, float]:
    """(bytes, seconds) of reading every file start to end in `chunk`-byte reads into one reused
    buffer: the sequential-read time a loader of the same bytes is measured against."""
    view = memoryview(bytearray(chunk))
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def prepare_page_cache(directory: str | Path, cache: str) -> float:
    """Make the checkpoint's page cache `cache` ("cold": every file of the directory evicted;
    "warm": the safetensors files read once); the resident share of its safetensors files after."""
    files = checkpoint_files(directory)
    if cache == "cold":
        evict_page_cache([p for p in Path(directory).iterdir() if p.is_file()])
    elif cache == "warm":
        read_files(files)
    else:
        raise ValueError(f"cache must be 'cold' or 'warm', got {cache!r}")
    return resident_fraction(files)


# ---- the runner's side of the load-time measurement ---------------------------------------------------
def run_load_times(checkpoint: str | Path, *, weights: str, dtype: str, threads: int, time_limit: float,
                   mem_limit: Callable[[], int], log: Callable[[str], None]) -> dict[str, Any]:
    """Read time and load time of `checkpoint`, cold then warm, each in a fresh `loadtime` cell."""
    from .spawn import run_subprocess_cell
    rec: dict[str, Any] = {"checkpoint": str(checkpoint), "target_ratio": LOAD_TARGET_RATIO,
                           "cold_resident_max": COLD_RESIDENT_MAX}
    for cache in ("cold", "warm"):
        runs = {}
        for what in ("read", "load"):
            log(f"load times: {what} the checkpoint, {cache} page cache")
            raw = run_subprocess_cell("loadtime", checkpoint=str(checkpoint), threads=threads, time_limit=time_limit,
                                      mem_limit_bytes=mem_limit(), extra=["--what", what, "--cache", cache,
                                                                          "--weights", weights, "--dtype", dtype])
            runs[what] = dict(raw["phases"].get("done") or {}, status=raw["status"])
            if raw["status"] != "ok":
                err = raw["phases"].get("error", {}).get("error") or raw.get("stderr_tail", "")
                runs[what]["detail"] = err[-500:]
        rec[cache] = load_time_row(runs["read"], runs["load"], cache)
    return rec


def load_time_row(read: dict[str, Any], load: dict[str, Any], cache: str) -> dict[str, Any]:
    """One page-cache state's record: both runs, the load/read ratio, and (cold) whether eviction held."""
    row: dict[str, Any] = {"read": read, "load": load, "read_s": read.get("seconds"), "load_s": load.get("seconds"),
                           "bytes": read.get("bytes") or load.get("bytes")}
    ok = read.get("status") == "ok" and load.get("status") == "ok" and row["read_s"] and row["load_s"]
    row["ratio"] = row["load_s"] / row["read_s"] if ok else None
    if cache == "cold":
        worst = max((r.get("resident_before") or 0.0) for r in (read, load))
        row["cold_reached"] = worst <= COLD_RESIDENT_MAX
    return row
