"""Batch-invariant row arithmetic.

In batch-invariant mode a row's result must not depend on which other rows share a call: a
sequence's tokens must not change with the server's load, and a prefix-cache hit must be
bit-identical to a cold run. Two CPU effects break that, both measured here (torch 2.13, MKL,
AVX2, 1 and 2 threads):
  * GEMM kernels: a row gets the same bits for any row count that is a multiple of 4 between 4
    and 256, and other bits at 1-3 rows or past 256 (other kernels, other blocking);
  * vectorised elementwise kernels (sigmoid, exp, silu, ...) compute the last numel % 16 elements
    of a tensor with a scalar routine whose bits differ from the SIMD one.
So invariant batches pad their rows to a multiple of ROW_MULTIPLE = 8 (every [rows, n] tensor
with even n then has numel % 16 == 0), the routed experts' rows to a multiple of 4
(`pad_index`), and `row_mm` runs more than ROW_TILE rows in tiles while `invariant_rows()` is
active (outside it, a prefill GEMM reads each weight once for all its rows).

The price is the small-batch GEMM: on this CPU a 4-row GEMM costs 3-7x a 1-row GEMV, so a lone
decode step runs slower in this mode; it is the serving engine's default, not the library's.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 8
EXPERT_ROW_MULTIPLE = 4
ROW_TILE = 256


def padded_count(n: int, multiple: int = ROW_MULTIPLE) -> int:
    """The smallest positive multiple of `multiple` that holds n rows."""
    return max(multiple, -(-n // multiple) * multiple)


def pad_index(index: torch.Tensor, multiple: int = EXPERT_ROW_MULTIPLE) -> torch.Tensor:
    """Row indices padded (by repeating the first) to a row count a matmul gives invariant bits for."""
    n = index.shape[0]
    extra = padded_count(n, multiple) - n
    if extra == 0:
        return index
    return torch.cat([index, index[:1].expand(extra)])


_TILE: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvfold_row_tile", default=None)


@contextlib.contextmanager
def invariant_rows(on: bool = True):
    """Within: `row_mm` (and `row_tile()` readers) split long inputs into ROW_TILE-row tiles."""
    token = _TILE.set(ROW_TILE if on else None)
    try:
        yield
    finally:
        _TILE.reset(token)


def row_tile() -> int | None:
    """The row tile in force (None: whole inputs)."""
    return _TILE.get()


def rows_invariant() -> bool:
    """Whether the current model call runs in batch-invariant mode (inside `invariant_rows()`)."""
    return _TILE.get() is not None


def row_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T; inside `invariant_rows()`, rows in tiles of ROW_TILE."""
    tile = _TILE.get()
    if tile is None or x.numel() <= tile * x.shape[-1]:
        return F.linear(x, weight)
    if x.dim() != 2:
        return row_mm(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return torch.cat([F.linear(x[i:i + tile], weight) for i in range(0, x.shape[0], tile)])
