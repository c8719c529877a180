"""The switch for the Triton kernels (triton_kernels.py): off by default.

`use_triton(True)` (or KVFOLD_TRITON=1 in the environment) turns them on for tensors on a device
they can run on: CUDA, or any device while Triton's interpreter is on (TRITON_INTERPRET=1, how
the CPU tests run them). The dispatch points are the ops' own: `fold.pool_windows`, the
attention's `_attend` and the indexer's `select`. triton is imported only when they are on.

Batch-invariant mode on CUDA runs the fixed-order row kernels (triton_rows.py) whatever the
switch says, since torch's kernels there promise no batch invariance (`fixed_rows`).
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os

import torch

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("kvfold_triton", default=os.environ.get("KVFOLD_TRITON") == "1")


@contextlib.contextmanager
def use_triton(on: bool = True):
    """Within: the Triton kernels on (where `kernels_for` allows) or off."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def switched_on() -> bool:
    """Whether `use_triton` (or KVFOLD_TRITON=1) has the kernels on here."""
    return _ON.get()


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on `device`: triton installed, and CUDA or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def kernels_for(device: torch.device | str):
    """The kernels module when they are on and can run on `device`, else None (the caller runs torch)."""
    if not _ON.get() or not available(device):
        return None
    from . import triton_kernels
    return triton_kernels


_ROWS_ON_CPU: contextvars.ContextVar[bool] = contextvars.ContextVar("kvfold_triton_rows_cpu", default=False)


@contextlib.contextmanager
def fixed_rows_on_cpu(on: bool = True):
    """Within: batch-invariant mode on the CPU takes the Triton row kernels (under the interpreter)
    instead of native.c, as it does on CUDA: how the tests check the CUDA path on a CPU (with
    native.c off too, `native.use_native(False)`, so that no op takes native.c's kernels)."""
    token = _ROWS_ON_CPU.set(bool(on))
    try:
        yield
    finally:
        _ROWS_ON_CPU.reset(token)


def fixed_rows(device: torch.device | str):
    """The fixed-order row kernels (triton_rows.py) for batch-invariant mode on `device`, or None:
    on CUDA whenever triton is installed; on the CPU only inside `fixed_rows_on_cpu()`."""
    dev = torch.device(device)
    if (dev.type == "cpu" and not _ROWS_ON_CPU.get()) or not available(dev):
        return None
    from . import triton_rows
    return triton_rows
