"""Safetensors files mapped into memory and read in place.

A tensor read from a checkpoint is a view of its file's mapping, not a copy. The mapping is
read-only: a write through a view faults rather than reaching the file or copying a page, and a
read-only mapping counts against neither the process's data limit nor the system's commit charge
(a private writable one would, for the whole file). A weight held as stored
(`weights="quantized"`) stays such a view, and the model's weights are then the page cache's
pages, with no anonymous memory to fault in and fill. On a 2-core Zen 4 VM, filling fresh
anonymous memory ran at 3.4 GB/s while reading the cached files ran at 11 GB/s
(bench/RESULTS.md), so a copying loader could not come near the time to read the files.

`ResidentPages` then locks the pages a model holds in memory (mlock), so that a loaded model is
resident and stays so: the first forward does not read the files from disk, and other files read
later do not push the weights out of the page cache. A file a model reads in place must not be
rewritten while the model is loaded (as with any mmap-based engine): its pages are the weights.
"""
from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import struct
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import CheckpointError

# safetensors dtype names -> torch dtypes (F4: two e2m1 codes a byte, as torch's float4 x2)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8), "F4": getattr(torch, "float4_e2m1fn_x2", torch.uint8),
}
_MADV_POPULATE_READ = 22  # Linux 5.14+


class Entry(NamedTuple):
    file: Path
    dtype: str           # safetensors dtype name
    shape: tuple          # as the header lists it (F4: in fp4 elements)
    offset: int           # the first byte, from the start of the file
    nbytes: int


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of a safetensors file by name, their byte ranges checked against the file: a
    CheckpointError names the first that is not a tensor of its dtype and shape inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path} is not a safetensors file: its header claims {n} bytes of {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not JSON: {e}") from None
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {key} has no dtype, shape and data_offsets") from None
        entry = Entry(path, dtype, shape, 8 + n + begin, end - begin)
        if not 0 <= begin <= end or entry.offset + entry.nbytes > size:
            raise CheckpointError(f"{path}: tensor {key}'s bytes [{begin}, {end}) are not inside the file")
        if dtype in SAFETENSORS_DTYPES and entry.nbytes != _nbytes(dtype, shape):
            raise CheckpointError(f"{path}: tensor {key} holds {entry.nbytes} bytes, but {dtype} {list(shape)} "
                                  f"is {_nbytes(dtype, shape)}")
        entries[key] = entry
    return entries


def _nbytes(dtype: str, shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return (n + 1) // 2 if dtype == "F4" else n * SAFETENSORS_DTYPES[dtype].itemsize


class MappedFile:
    """One safetensors file, mapped read-only on the first `tensor`; the mapping lives as long as
    any tensor viewing it."""

    def __init__(self, path: Path, mappings: set[tuple[int, int]]):
        """`mappings`: where the mapping's `storage_key` is added once it is made."""
        self.path, self.mappings = path, mappings
        self._bytes: torch.Tensor | None = None

    def tensor(self, entry: Entry) -> torch.Tensor:
        """The tensor `entry` as a view of the mapped file (a copy where the file does not align
        it to its element size: safetensors' own writer always does)."""
        if sys.byteorder != "little":
            raise CheckpointError("safetensors stores little-endian tensors; this machine is big-endian")
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.path}: dtype {entry.dtype} is not one kvfold reads")
        if self._bytes is None:
            try:
                with open(self.path, "rb") as f:
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.path}: cannot memory-map the file ({e}); kvfold reads checkpoints "
                                      "from a file system that supports mmap (copy it to a local disk)") from None
            with warnings.catch_warnings():  # torch warns that it cannot mark a tensor read-only
                warnings.simplefilter("ignore", UserWarning)
                self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
            self.mappings.add(storage_key(self._bytes))
        raw = self._bytes[entry.offset:entry.offset + entry.nbytes]
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        shape = entry.shape
        if entry.dtype == "F4":
            shape = shape[:-1] + (shape[-1] // 2,)
        if raw.data_ptr() % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(shape)


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage `t` views: what a MappedFile adds to its `mappings`."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@functools.lru_cache(maxsize=1)
def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


class ResidentPages:
    """Keeps the pages of the tensors a model holds in place (views of `mappings`, MappedFile keys)
    in memory. `hold` records them as the loader keeps them; `settle` then locks each file's
    recorded ranges (mlock: read from disk where not cached, in file order, and never dropped while
    the model maps them), so a model read in place stays as resident as one copied into memory of
    its own would, and other files read later do not push it out. Where the process may not lock
    (RLIMIT_MEMLOCK without CAP_IPC_LOCK, or not enough memory), the pages are only mapped in
    (MADV_POPULATE_READ) and `note` says so: the kernel may then drop pages not read lately and
    read them again from the files. Ranges are locked merged, a file at a time: each mlock call
    splits the mapping, and a call a tensor made loads slower."""

    def __init__(self, mappings: set[tuple[int, int]], lock: bool = True):
        self.mappings, self.lock = mappings, lock
        self.pending: dict[tuple[int, int], list[tuple[int, int]]] = {}  # mapping -> (address, bytes) held
        self.locked = self.unlocked = 0  # bytes
        self.refusal = ""

    def hold(self, tensors) -> None:
        """Record the mapped tensors among `tensors` (None and other tensors are passed over)."""
        for t in tensors:
            if t is not None and t.numel() and t.is_cpu:
                key = storage_key(t)
                if key in self.mappings:
                    self.pending.setdefault(key, []).append((t.data_ptr(), t.numel() * t.element_size()))

    def settle(self) -> None:
        """Lock (or map in) what `hold` recorded since the last call."""
        lib = _libc()
        for key in sorted(self.pending):
            for lo, hi in _merged(self.pending[key]):
                if self.lock and lib.mlock(lo, hi - lo) == 0:
                    self.locked += hi - lo
                    continue
                if self.lock:  # refused once: the rest only mapped in, without asking again
                    self.lock, self.refusal = False, os.strerror(ctypes.get_errno())
                if lib.madvise(lo, hi - lo, _MADV_POPULATE_READ) != 0:
                    _touch(lo, hi - lo, mmap.PAGESIZE)
                self.unlocked += hi - lo
        self.pending.clear()

    def note(self) -> str | None:
        """What a load reports where some pages could not be locked; None where all were."""
        if not self.unlocked:
            return None
        why = f" ({self.refusal})" if self.refusal else ""
        return (f"{self.unlocked / 2**30:.2f} GiB of weights read in place are not locked in memory{why}: under "
                f"memory pressure the kernel may drop their pages and read them again from the files; allow "
                f"locking (`ulimit -l unlimited`, or CAP_IPC_LOCK) to keep them resident")


def _merged(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """(address, bytes) ranges as page-aligned [lo, hi) ranges, those that touch merged."""
    page = mmap.PAGESIZE
    merged: list[list[int]] = []
    for start, n in sorted(set(ranges)):
        lo, hi = start // page * page, -(-(start + n) // page) * page
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def _touch(addr: int, n: int, page: int) -> None:
    """Read one byte of each page of [addr, addr + n)."""
    pages = (ctypes.c_uint8 * n).from_address(addr)
    torch.frombuffer(pages, dtype=torch.uint8)[::page].sum()
