"""The rows one model call runs: the tokens of one or more sequences, concatenated.

Token-parallel work (embedding, mHC, norms, projections, MoE, lm_head) runs once over all rows,
reading each weight once for the whole batch; only what reads or writes a sequence's state
(compressors, indexer, attention, window ring) loops over the segments. A single sequence is a
batch of one segment: one code path. In batch-invariant mode (numerics/rows.py) the
token-parallel ops give every row the bits it would get alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..numerics.backend import Backend


@dataclass
class Segment:
    """One sequence's rows in a batch: rows [r0, r1) at positions start .. start + (r1 - r0) - 1."""
    r0: int
    r1: int
    start: int
    state: object  # the sequence's state (its `layers[i]` is layer i's LayerState)
    # each row as a decode row, one after another (a verify step: its rows' bits are plain decoding's)
    decode_rows: bool = False

    @property
    def rows(self) -> slice:
        return slice(self.r0, self.r1)

    def parts(self) -> list["Segment"]:
        """The per-sequence work units: the segment whole, or with `decode_rows` each row alone,
        in order (each then sees the rows before it in the state, as decoding does)."""
        if not self.decode_rows or self.length == 1:
            return [self]
        return [Segment(r, r + 1, self.start + r - self.r0, self.state) for r in range(self.r0, self.r1)]

    @property
    def length(self) -> int:
        return self.r1 - self.r0


@dataclass
class RowBatch:
    token_ids: torch.Tensor  # [R]
    positions: torch.Tensor  # [R]
    segments: list[Segment]
    ops: Backend  # the model's kernels for this call's mode (numerics/backend.py), passed to every layer
    rope: dict = field(default_factory=dict)  # kind -> (RopeTable, cos [R, rd/2], sin [R, rd/2])

    @classmethod
    def build(cls, pieces: list[tuple[torch.Tensor, object]], device: torch.device, ops: Backend,
              decode_rows: frozenset[int] = frozenset()) -> "RowBatch":
        """pieces: (token ids [T_i], state at position state.pos) per sequence, in row order.
        `decode_rows`: the ids of the states whose rows run as decode rows (`Segment.parts`)."""
        segments, ids, pos_parts, r = [], [], [], 0
        for tok, st in pieces:
            t = tok.numel()
            segments.append(Segment(r, r + t, st.pos, st, id(st) in decode_rows))
            ids.append(tok)
            pos_parts.append(torch.arange(st.pos, st.pos + t, device=device))
            r += t
        return cls(torch.cat(ids) if len(ids) > 1 else ids[0],
                   torch.cat(pos_parts) if len(pos_parts) > 1 else pos_parts[0], segments, ops)

    def moved(self, token_ids: torch.Tensor, positions: torch.Tensor, ops: Backend) -> "RowBatch":
        """The same rows and segments with their ids and positions on another device (copies the
        caller made) and that device's kernels: what a placed model's layers there read."""
        return RowBatch(token_ids, positions, self.segments, ops)

    @property
    def rows(self) -> int:
        return self.token_ids.shape[0]

    def last_rows(self) -> torch.Tensor | slice:
        """Index of each segment's last row."""
        if len(self.segments) == 1:
            return slice(self.rows - 1, self.rows)  # a view, no gather
        return torch.tensor([s.r1 - 1 for s in self.segments], device=self.token_ids.device)

    def _last_flags(self, last_only: bool | Sequence[bool]) -> list[bool]:
        if isinstance(last_only, bool):
            return [last_only] * len(self.segments)
        return [bool(f) for f in last_only]

    def scored_rows(self, last_only: bool | Sequence[bool]) -> torch.Tensor | slice:
        """The rows whose logits are wanted: each segment's last row where its `last_only` flag
        (one for all, or one per segment) is set, all its rows where it is not."""
        flags = self._last_flags(last_only)
        if all(flags):
            return self.last_rows()
        if not any(flags):
            return slice(0, self.rows)
        return torch.cat([torch.arange(s.r1 - 1 if last else s.r0, s.r1, device=self.token_ids.device)
                          for s, last in zip(self.segments, flags)])

    def split_scored(self, logits: torch.Tensor, last_only: bool | Sequence[bool]) -> list[torch.Tensor]:
        """The logits of `scored_rows`, one tensor per segment ([1, vocab] or [T_i, vocab])."""
        out, r = [], 0
        for s, last in zip(self.segments, self._last_flags(last_only)):
            n = 1 if last else s.length
            out.append(logits[r:r + n])
            r += n
        return out

