"""Native fp32 CPU row kernels (native.c), compiled once per machine and loaded with ctypes.

On the CPU a decode step is dominated by per-call overhead: each aten op costs 10-20 us, whatever
its size, and RMSNorm, rope, the mHC collapse and expand, and a decode batch's MoE are 4 to 35 ops each.
One call into native.c replaces each of them. The kernels treat every row alone in a fixed
order, so a row's bits never depend on its batch (batch-invariant by construction).

The library builds native.c with the system C compiler (`cc`, or $CC) into a per-user cache
($KVFOLD_CACHE_DIR, else $XDG_CACHE_HOME/kvfold, else ~/.cache/kvfold) on first use, keyed by the
source, flags and CPU; without a compiler `library()` is None, with one warning, and every model
runs the torch references (numerics/backend.py chooses, once per model, which ops run native.c:
KVFOLD_NATIVE=0 or `model.set_kernels(KernelSet(native=False))` turns it off for A/B runs).
KVFOLD_NATIVE_ISA=avx2 builds them without AVX-512 (the same bits, checked by the tests).

Loading gives every function its ctypes signature and holds every struct the Python side mirrors
to the library's own layout of it (native_abi.py); a difference refuses the library with a
NativeAbiError, raised by every `library()` call, not a fallback to torch: it is a bug in kvfold.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..errors import NativeAbiError
from ..paths import cache_root
from . import native_abi

_SOURCE = Path(__file__).with_name("native.c")
# every header beside it, so that an edit to any header native.c includes builds a new library
_HEADERS = tuple(sorted(_SOURCE.parent.glob("native_*.h")))
# -ffp-contract=off: every C expression is evaluated as written (no fused multiply-adds chosen by the
# compiler), so the kernels' arithmetic is fixed by the source (native.c's header).
_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-std=c11", "-ffp-contract=off"]
# tried in order: a compiler without -march=native or OpenMP still builds the kernels (single-threaded)
_VARIANTS = (["-march=native", "-fopenmp"], ["-fopenmp"], [])
# KVFOLD_NATIVE_ISA=avx2 builds without AVX-512, as an AVX2 machine would: the kernels promise the
# same bits with and without it (native_weights.h), and `make test` checks that on one machine.
_ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_refused: NativeAbiError | None = None  # the loaded library's ABI differs from native_abi.py's
_tried = False


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's flags (the build is not portable across CPUs)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _isa_flags() -> list[str]:
    isa = os.environ.get("KVFOLD_NATIVE_ISA", "native")
    if isa not in _ISA_FLAGS:
        raise ValueError(f"KVFOLD_NATIVE_ISA={isa!r}: use one of {', '.join(_ISA_FLAGS)}")
    return _ISA_FLAGS[isa]


def _build(compiler: str) -> Path:
    isa = _isa_flags()
    for extra in _VARIANTS[:-1]:
        try:
            return _build_with(compiler, _FLAGS + extra + isa)
        except subprocess.CalledProcessError:
            pass
    return _build_with(compiler, _FLAGS + _VARIANTS[-1])


def _build_with(compiler: str, flags: list[str]) -> Path:
    src = b"".join(p.read_bytes() for p in (_SOURCE, *_HEADERS))
    key = hashlib.sha256(src + " ".join([compiler, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    target = cache_root() / f"native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; None when they cannot be built. Raises
    NativeAbiError when the library's structs or functions differ from native_abi.py's."""
    global _lib, _refused, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _load()
                except NativeAbiError as e:
                    _refused = e
                _tried = True
    if _refused is not None:
        raise _refused.with_traceback(None)
    return _lib


def _load() -> ctypes.CDLL | None:
    """The library built and checked (native_abi.verify), or None, with one warning, when it cannot
    be built or loaded."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if compiler is None:
            raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"kvfold: native CPU kernels unavailable ({e}; {detail.decode(errors='replace')[:500]}); "
                      "using the slower torch path. Install a C compiler or set KVFOLD_NATIVE=0 to silence.",
                      RuntimeWarning, stacklevel=3)
        return None
    native_abi.verify(lib)
    return lib


def available() -> bool:
    return library() is not None


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a contiguous fp32 CPU tensor (what the kernels read)."""
    return all(t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)
