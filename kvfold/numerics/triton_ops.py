"""The switch for the Triton kernels (triton_kernels.py): off by default.

`use_triton(True)` (or KVFOLD_TRITON=1 in the environment) turns them on for tensors on a device
they can run on: CUDA, or any device while Triton's interpreter is on (TRITON_INTERPRET=1, how
the CPU tests run them). The dispatch points are the ops' own: `fold.pool_windows`, the
attention's `_attend` and the indexer's `select`. triton is imported only when they are on.
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
    """Within: the Triton kernels on (where `serving` allows) or off."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on `device`: triton installed, and CUDA or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def serving(device: torch.device | str):
    """The kernels module when they are on and can run on `device`, else None (the caller runs torch)."""
    if not _ON.get() or not available(device):
        return None
    from . import triton_kernels
    return triton_kernels
