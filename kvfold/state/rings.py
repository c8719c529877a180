"""A preallocated buffer whose row for absolute position p lives at slot p mod R.

Rewinding is moving a cursor (the owner's `pos`); rows beyond it are unreachable until a
later write replaces them. Nothing here ever grows or shifts rows.
"""
from __future__ import annotations

import torch


class PositionRing:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device, fill: float = 0.0):
        self.rows = rows
        self.data = torch.full((rows, width), fill, dtype=dtype, device=device)

    def slots(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.data.device) % self.rows

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end), oldest first. Caller guarantees end - start <= rows."""
        if end <= start:
            return self.data[:0]
        a, b = start % self.rows, (end - 1) % self.rows + 1
        if a < b:  # contiguous: a view, no copy
            return self.data[a:b]
        return self.data.index_select(0, self.slots(start, end))

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Write rows for positions [start, start + len(rows)); only the last `self.rows` land."""
        n = rows.shape[0]
        if n > self.rows:
            start, rows = start + n - self.rows, rows[n - self.rows:]
            n = self.rows
        a = start % self.rows
        first = min(n, self.rows - a)
        self.data[a:a + first] = rows[:first].to(self.data.dtype)
        if first < n:
            self.data[:n - first] = rows[first:].to(self.data.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
