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

from ...errors import PagePoolError, RewindError, SharedPageWriteError
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
                     pool: PagedRows | None = None) -> CompressorState:
    """`pool`: the entry pool as a view of shared pages; None reserves a private one."""
    m = 2 if overlap else 1
    rows = (2 * ratio if overlap else ratio) + max_rewind
    return CompressorState(
        ratio=ratio, overlap=overlap,
        kv=PositionRing(rows, m * width, torch.float32, device, 0.0),
        score=PositionRing(rows, m * width, torch.float32, device, float("-inf")),
        pool=pool if pool is not None else KvRows(-(-capacity // ratio), width, dtype, device, fp8_nope),
    )


class Dsv4State(SequenceState):
    """One sequence. Create with `model.new_state(capacity, max_rewind)`; never construct directly."""

    def __init__(self, layers: list[LayerState], *, window: int, capacity: int, max_rewind: int,
                 fingerprint: str, device: torch.device, dtype: torch.dtype, kv_fp8: bool = False,
                 pages: PagePool | None = None, page_table: list[int] | None = None, prefix_tokens: int = 0):
        super().__init__(layers, capacity=capacity, max_rewind=max_rewind, fingerprint=fingerprint,
                         device=device, dtype=dtype)
        self.window = window
        self.kv_fp8 = kv_fp8  # window rows and compressed entries stored as FP8 (non-rope dims)
        # paged states: the pool their compressed entries live in, and their page table (the
        # first prefix_tokens // page_tokens pages were taken by reference from another holder)
        self.pages = pages
        self._page_table: list[int] = list(page_table or [])
        self.prefix_tokens = prefix_tokens

    # ---- pages -------------------------------------------------------------------------------
    @property
    def paged(self) -> bool:
        return self.pages is not None

    @property
    def page_table(self) -> list[int]:
        """The pool pages holding this state's compressed entries (page j: positions
        [j * page_tokens, (j + 1) * page_tokens)); empty for a private or freed state."""
        return list(self._page_table)

    def share_prefix(self, n_tokens: int) -> list[int]:
        """Take a reference to the pages of positions [0, n_tokens) for another holder (the
        prefix cache), and never write them again: rewinding below n_tokens is refused from now
        on. `n_tokens` must be a whole number of pages, at most `pos`. Returns the page ids;
        the caller owns one reference to each (`pages.decref` them when done)."""
        self._check_alive()
        if self.pages is None:
            raise PagePoolError("share_prefix needs a paged state: new_state(..., pages=pool)")
        pt = self.pages.page_tokens
        if n_tokens < 0 or n_tokens % pt or n_tokens > self.pos:
            raise PagePoolError(f"share_prefix({n_tokens}): must be a multiple of the page size {pt} and at most "
                                f"pos {self.pos}")
        shared = self._page_table[:n_tokens // pt]
        self.pages.incref(shared)
        self.rewind_floor = max(self.rewind_floor, n_tokens)
        return list(shared)

    def _next_page_shared(self) -> int | None:
        """The page the next forward writes first, if another holder references it."""
        if self.pages is None or self.pos >= self.capacity:
            return None
        page = self._page_table[self.pos // self.pages.page_tokens]
        return page if self.pages.refcount(page) > 1 else None

    def check_usable(self, fingerprint: str, device: torch.device, dtype: torch.dtype) -> None:
        super().check_usable(fingerprint, device, dtype)
        page = self._next_page_shared()
        if page is not None:  # refused before the forward writes anything
            raise SharedPageWriteError(
                f"state kv_id={self.kv_id} at pos {self.pos} would write page {page}, which other holders "
                f"reference; a state created with prefix pages must first restore the snapshot taken at their "
                f"end (pos {self.prefix_tokens})")

    def free(self) -> None:
        """Release every buffer and drop this state's page references. Idempotent."""
        if self.layers is not None and self.pages is not None:
            table, self._page_table = self._page_table, []
            self.pages.decref(table)
        super().free()

    def snapshot(self, pools: bool = True) -> bytes:
        """The rows still in use at `pos` (docs/state-format.md). `pools=False` leaves out the
        compressed and indexer pools' rows (flag 0x100): the prefix cache keeps those as pages
        and restores such a blob only into a state holding them by reference."""
        self._check_alive()
        from .snapshot import encode
        return encode(self, pools=pools)

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

    def _encode(self) -> bytes:
        from .snapshot import encode
        return encode(self)

    def _decode_and_apply(self, blob: bytes) -> None:
        from .snapshot import decode_and_apply
        decode_and_apply(self, blob)
