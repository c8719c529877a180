"""Batch-invariant row matmuls.

A row's result must not depend on which other rows share a call, or a sequence's tokens would
change with the server's load (and a prefix-cache hit could not be bit-identical to a cold
run). CPU GEMMs give a row the same bits for any row count that is a multiple of 4 between 4
and 256 (measured for MKL fp32 at 1 and 2 threads; other counts take other kernels), so every
token-parallel matmul sees such a count: callers pad rows to a multiple of ROW_MULTIPLE
(`padded_count`, `pad_index`) and `row_mm` runs longer inputs in tiles of ROW_TILE rows.
"""
from __future__ import annotations

import torch

ROW_MULTIPLE = 4
ROW_TILE = 256


def padded_count(n: int) -> int:
    """Rows a batch of n real rows runs with (a multiple of ROW_MULTIPLE, at least one multiple)."""
    return max(ROW_MULTIPLE, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def pad_index(index: torch.Tensor) -> torch.Tensor:
    """Row indices padded (by repeating the first) to a row count a matmul gives invariant bits for."""
    n = index.shape[0]
    extra = padded_count(n) - n
    if extra == 0:
        return index
    return torch.cat([index, index[:1].expand(extra)])


def row_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T, with rows in tiles of at most ROW_TILE (see the module doc)."""
    if x.numel() <= ROW_TILE * x.shape[-1]:
        return x @ weight.t()
    if x.dim() != 2:
        return row_mm(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return torch.cat([x[i:i + ROW_TILE] @ weight.t() for i in range(0, x.shape[0], ROW_TILE)])
