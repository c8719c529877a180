"""A preallocated buffer whose row for absolute position p lives at slot p mod R.

Rewinding is moving a cursor (the owner's `pos`); rows beyond it are unreachable until a
later write replaces them. Nothing here ever grows or shifts rows.
"""
from __future__ import annotations

import torch

from .kv_rows import KvRows


class PositionRing:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device, fill: float = 0.0,
                 fp8_nope: int | None = None):
        self.rows = rows
        self.store = KvRows(rows, width, dtype, device, fp8_nope, fill)

    @classmethod
    def over(cls, data: torch.Tensor) -> "PositionRing":
        """A ring whose slots are the rows of `data` [rows, width] (plain dtype), owned elsewhere."""
        ring = cls.__new__(cls)
        ring.rows, ring.store = data.shape[0], KvRows.over(data)
        return ring

    @property
    def data(self) -> torch.Tensor:
        """Every slot, decoded (a view in the plain dtype; a copy in FP8 mode)."""
        return self.store[:]

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end), oldest first. Caller guarantees end - start <= rows."""
        parts = self.runs(start, end)
        if len(parts) < 2:  # contiguous: a view, no copy (plain dtype)
            return parts[0] if parts else self.store[0:0]
        return torch.cat(parts)  # wrapped: two views, one copy

    def runs(self, start: int, end: int) -> list[torch.Tensor]:
        """read(start, end) as its one or two runs of consecutive slots, oldest first, uncopied
        (views in the plain dtype; decoded copies in FP8 mode)."""
        if end <= start:
            return []
        a, b = start % self.rows, (end - 1) % self.rows + 1
        return [self.store[a:b]] if a < b else [self.store[a:], self.store[:b]]

    def read_then(self, start: int, end: int, tail: torch.Tensor) -> torch.Tensor:
        """read(start, end) followed by the rows of `tail`, in one copy (attention's window keys:
        the ring's rows, then the chunk's own)."""
        if tail.dtype != self.store.dtype:
            tail = tail.to(self.store.dtype)
        return torch.cat([*self.runs(start, end), tail]) if end > start else tail

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Write rows for positions [start, start + len(rows)); only the last `self.rows` land."""
        n = rows.shape[0]
        if n > self.rows:
            start, rows = start + n - self.rows, rows[n - self.rows:]
            n = self.rows
        a = start % self.rows
        first = min(n, self.rows - a)
        self.store[a:a + first] = rows[:first]
        if first < n:
            self.store[:n - first] = rows[first:]

    @property
    def nbytes(self) -> int:
        return self.store.nbytes
