"""Per-sequence state of a DeepSeek-V4 model: explicit buffers, preallocated, addressed by position.

Everything visible derives from `pos` (tokens consumed): window rows cover positions
[max(0, pos - W + 1), pos), compressed and indexer entries [0, pos // r). The compressors'
open (and, for CSA, previous) windows are the token rows of positions >= (pos//r)*r - r, kept
in position rings with `max_rewind` rows of slack so a rejected draft never overwrites a row
the next fold still needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import RewindError
from ...state.base import SequenceState
from ...state.kv_rows import KvRows
from ...state.pages import PagedRows, PagePool
from ...state.rings import PositionRing


@dataclass
class CompressorState:
    """One compressor's token rows (kv, score with `ape` added; fp32) and its entry pool."""
    ratio: int
    overlap: bool
    kv: PositionRing
    score: PositionRing
    pool: KvRows | PagedRows  # [ceil(capacity / ratio), c]; entry w at row w (private, or in shared pages)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.score.nbytes + self.pool.nbytes


@dataclass
class LayerState:
    window: PositionRing
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @property
    def nbytes(self) -> int:
        n = self.window.nbytes
        for c in (self.compressor, self.indexer):
            if c is not None:
                n += c.nbytes
        return n


def compressor_state(ratio: int, overlap: bool, width: int, capacity: int, max_rewind: int,
                     dtype: torch.dtype, device: torch.device, fp8_nope: int | None = None,
                     pool: PagedRows | None = None, rings: tuple[PositionRing, PositionRing] | None = None
                     ) -> CompressorState:
    """`pool`: the entry pool as a view of shared pages; None reserves a private one. `rings`: the
    (kv, score) rings as views of an arena's slot (`compressor_rings`); None reserves them."""
    m = 2 if overlap else 1
    rows = compressor_ring_rows(ratio, overlap, max_rewind)
    kv, score = rings if rings is not None else (PositionRing(rows, m * width, torch.float32, device, 0.0),
                                                 PositionRing(rows, m * width, torch.float32, device, float("-inf")))
    return CompressorState(
        ratio=ratio, overlap=overlap, kv=kv, score=score,
        pool=pool if pool is not None else KvRows(-(-capacity // ratio), width, dtype, device, fp8_nope),
    )


def compressor_ring_rows(ratio: int, overlap: bool, max_rewind: int) -> int:
    """Rows of a compressor's rings: the open window (and, overlapping, the one before it) plus
    the rows a rewind may take back."""
    return (2 * ratio if overlap else ratio) + max_rewind


class Dsv4State(SequenceState):
    """One sequence. Create with `model.new_state(capacity, max_rewind)`; never construct directly."""

    def __init__(self, layers: list[LayerState], *, window: int, capacity: int, max_rewind: int,
                 fingerprint: str, device: torch.device, dtype: torch.dtype, kv_fp8: bool = False,
                 pages: PagePool | None = None, page_table: list[int] | None = None, prefix_tokens: int = 0,
                 arena=None, slot: int | None = None):
        super().__init__(layers, capacity=capacity, max_rewind=max_rewind, fingerprint=fingerprint,
                         device=device, dtype=dtype, pages=pages, page_table=page_table, prefix_tokens=prefix_tokens,
                         arena=arena, slot=slot)
        self.window = window
        self.kv_fp8 = kv_fp8  # window rows and compressed entries stored as FP8 (non-rope dims)

    # ---- cursors ----------------------------------------------------------------------------
    def rewind_to(self, n: int) -> None:
        """Undo the tokens after position n (a rejected draft). Only shrinks, by at most
        `max_rewind` tokens; rows past n become unreachable and are overwritten later."""
        self._check_alive()
        if n > self.pos:
            raise RewindError(f"rewind_to({n}) would grow the sequence (pos is {self.pos}); rewind only shrinks")
        if n < 0 or n < self.pos - self.max_rewind:
            raise RewindError(
                f"rewind_to({n}) undoes {self.pos - n} tokens but this state keeps only max_rewind="
                f"{self.max_rewind}; create it with model.new_state(..., max_rewind={max(self.pos - n, 0)}) "
                f"or restore an earlier snapshot")
        if n < self.rewind_floor:
            raise RewindError(f"rewind_to({n}) goes below position {self.rewind_floor}, where this state was "
                              f"restored from a snapshot; restore an earlier snapshot instead")
        self.pos = n

    def advance(self, k: int) -> None:
        """Re-expose k rows already written past pos (by a verify pass that was rewound)."""
        self._check_alive()
        if k < 0 or self.pos + k > self.written_until:
            raise RewindError(f"advance({k}) from pos {self.pos} passes the rows written so far "
                              f"(up to {self.written_until}); run forward() on those tokens instead")
        self.pos += k

    def sync_to(self, seq_len: int, k: int) -> None:
        """Reconcile after a verify pass: rewind to seq_len if ahead, refuse if behind, then
        advance by the k rows the pass wrote for accepted tokens. Refusals change nothing."""
        self._check_alive()
        if self.pos < seq_len:
            raise RewindError(f"sync_to({seq_len}, {k}): state is behind (pos {self.pos}); "
                              f"feed the missing tokens with forward() first")
        if seq_len + k > self.written_until or k < 0:
            raise RewindError(f"sync_to({seq_len}, {k}) needs rows up to {seq_len + k} but only "
                              f"{self.written_until} were written")
        if seq_len < self.pos:
            self.rewind_to(seq_len)
        self.pos = seq_len + k

    def _encode(self, pools: bool = True) -> bytes:
        from .snapshot import encode
        return encode(self, pools=pools)

    def _decode_and_apply(self, blob: bytes) -> None:
        from .snapshot import decode_and_apply
        decode_and_apply(self, blob)
