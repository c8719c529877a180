"""Compressed-KV pools in fixed-size pages shared by every sequence of one model.

One page holds the compressed entries of one `page_tokens`-token block (128 for DeepSeek-V4)
across ALL compressed pools of the model: a pool of ratio r keeps `page_tokens // r` rows of
the page. So one page table serves every layer of a sequence: page j of the table covers
positions [j * page_tokens, (j + 1) * page_tokens). Pools are prefix-shaped and append-only
(entry w = p // r is written once, when its window completes), so the entries of a page are
final once the sequence has passed the page's end. Window rings and compressor windows stay
per sequence (`Dsv4State`). GLM-5.3 keeps its MLA latent rows in pages the same way (ratio 1;
its DSA indexer rows stay flat per sequence, in `Glm5NextDsaState`).

`PagePool` owns the storage (one `KvRows` per layer pool, FP8 mode included), one free list
and one refcount per page. `PagedRows` is a sequence's view of one layer pool through its page
table: it reads and writes like the `KvRows` it replaces, and refuses any write into a page
somebody else also references (shared pages are immutable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PagePoolError, PagesExhaustedError, SharedPageWriteError
from .kv_rows import KvRows

COMPRESSOR, INDEXER, LATENT = "compressor", "indexer", "latent"


@dataclass(frozen=True)
class PoolSpec:
    """One layer pool held in pages: which layer and pool, its ratio and row geometry. `dtype`:
    the rows' storage dtype where it is not the pool's (GLM-5.3's FP8 latent rows)."""
    layer: int
    kind: str  # COMPRESSOR | INDEXER (DeepSeek-V4) | LATENT (GLM-5.3's MLA latent rows)
    ratio: int
    width: int
    fp8_nope: int | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None  # where its storage lives, where not the pool's (a placed model's layer)


class PagePool:
    """Preallocated pages for the compressed pools of every sequence of one model.

    Create with `model.new_page_pool(num_pages)`; give it to `model.new_state(..., pages=pool)`.
    A page is free (refcount 0) or referenced by one or more holders: states (their page
    tables) and the engine's prefix cache. Refusals change nothing."""

    holds_every_layer = True  # buffers of every layer: never tagged whole with one layer's device

    def __init__(self, specs: list[PoolSpec], num_pages: int, page_tokens: int, dtype: torch.dtype,
                 device: torch.device, *, fingerprint: str = "", kv_fp8: bool = False):
        if num_pages < 0:
            raise PagePoolError(f"num_pages must be >= 0, got {num_pages}")
        for s in specs:
            if page_tokens % s.ratio:
                raise PagePoolError(f"page_tokens {page_tokens} is not a multiple of layer {s.layer}'s "
                                    f"compress ratio {s.ratio}")
        self.specs = list(specs)
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.dtype, self.device = dtype, torch.device(device)
        self.fingerprint = fingerprint
        self.kv_fp8 = kv_fp8
        self.storages: dict[tuple[int, str], KvRows] = {
            (s.layer, s.kind): KvRows(num_pages * (page_tokens // s.ratio), s.width, s.dtype or dtype,
                                      s.device or device, s.fp8_nope)
            for s in specs}
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._shared = 0  # pages with refcount > 1

    # ---- geometry ----------------------------------------------------------------------------
    def rows_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: its rows in every layer pool."""
        return sum(self.rows_per_page(s.ratio) * self.storages[(s.layer, s.kind)].row_bytes for s in self.specs)

    def pages_for(self, capacity: int) -> int:
        """Pages a state of `capacity` tokens holds."""
        return -(-capacity // self.page_tokens)

    # ---- refcounts ---------------------------------------------------------------------------
    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """`n` free pages, each now referenced once. PagesExhaustedError (allocating nothing)
        when fewer than `n` are free."""
        if n < 0:
            raise PagePoolError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PagesExhaustedError(f"{n} pages needed but only {len(self._free)} of {self.num_pages} are free; "
                                      f"free states or evict the prefix cache, or make a larger pool")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check(self, pages, what: str) -> None:
        counts: dict[int, int] = {}
        for p in pages:
            if not (isinstance(p, int) and 0 <= p < self.num_pages):
                raise PagePoolError(f"cannot {what} page {p!r}: not a page of this pool (0..{self.num_pages - 1})")
            counts[p] = counts.get(p, 0) + 1
        for p, k in counts.items():
            if self._refs[p] < (k if what == "decref" else 1):
                raise PagePoolError(f"cannot {what} page {p}: it is free (refcount {self._refs[p]})"
                                    if what != "decref" or self._refs[p] == 0 else
                                    f"cannot decref page {p} {k} times: refcount is {self._refs[p]}")

    def incref(self, pages) -> None:
        """One more reference to each of `pages` (each must already be referenced)."""
        pages = list(pages)
        self._check(pages, "incref")
        for p in pages:
            self._refs[p] += 1
            if self._refs[p] == 2:
                self._shared += 1

    def decref(self, pages) -> None:
        """Drop one reference to each of `pages`; a page whose count reaches 0 is free again."""
        pages = list(pages)
        self._check(pages, "decref")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 1:
                self._shared -= 1
            elif self._refs[p] == 0:
                self._free.append(p)

    def take_table(self, capacity: int, prefix_pages, *, fingerprint: str, dtype: torch.dtype,
                   device: torch.device, kv_fp8: bool) -> list[int]:
        """The page table of a new state of `capacity` tokens: `prefix_pages` (taken by reference,
        one more reference each) then pages of its own. Refused, taking nothing, for a pool of
        another model, dtype, device or KV storage, more prefix pages than the capacity holds, or
        too few free pages (PagesExhaustedError)."""
        from ..errors import CapacityError, StateMismatchError
        prefix = list(prefix_pages or [])
        if self.fingerprint != fingerprint or self.dtype != dtype or self.device != torch.device(device):
            raise StateMismatchError(f"page pool belongs to {self.fingerprint}/{self.dtype}/{self.device}, "
                                     f"not this model; create it with this model's new_page_pool()")
        if self.kv_fp8 != kv_fp8:
            raise StateMismatchError(f"page pool KV storage is {'fp8' if self.kv_fp8 else 'plain'}; create the "
                                     f"state with the pool's kv_dtype")
        n_pages = self.pages_for(capacity)
        if len(prefix) > n_pages:
            raise CapacityError(f"{len(prefix)} prefix pages pass capacity {capacity} ({n_pages} pages)")
        self.incref(prefix)  # checks they are live pages of this pool
        try:
            return prefix + self.allocate(n_pages - len(prefix))
        except Exception:
            self.decref(prefix)
            raise

    # ---- counters ----------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def shared_pages(self) -> int:
        """Pages referenced more than once (by several sequences, or a sequence and the cache)."""
        return self._shared

    @property
    def nbytes(self) -> int:
        """Bytes of the whole preallocated pool."""
        return self.num_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    def stats(self) -> dict[str, int]:
        return dict(pages_total=self.num_pages, pages_used=self.used_pages, pages_free=self.free_pages,
                    pages_shared=self.shared_pages, page_bytes=self.page_bytes, page_bytes_total=self.nbytes,
                    page_bytes_used=self.used_bytes)

    # ---- views -------------------------------------------------------------------------------
    def view(self, layer: int, kind: str, table: list[int], rows: int, memo: dict | None = None) -> "PagedRows":
        """Layer pool (layer, kind) of the sequence whose page table is `table`, `rows` rows.
        `memo`: a dict shared by one state's views, so pools of one ratio share one row map."""
        spec = next(s for s in self.specs if (s.layer, s.kind) == (layer, kind))
        per = self.rows_per_page(spec.ratio)
        phys = None if memo is None else memo.get((per, rows))
        view = PagedRows(self, self.storages[(layer, kind)], per, table, rows, phys)
        if memo is not None:
            memo[(per, rows)] = view.phys
        return view

    def __repr__(self) -> str:
        return (f"PagePool({self.num_pages} pages of {self.page_tokens} tokens, {self.page_bytes} B each; "
                f"{self.used_pages} used, {self.shared_pages} shared)")


class PagedRows:
    """One sequence's rows [0, rows) of one layer pool, through its page table.

    Reads and writes like `KvRows`: `[a:b]`, `[i]`, `[long tensor of any shape]`, `[a:b] = rows`.
    Logical row i lives at physical row `table[i // P] * P + i % P` (P rows per page), precomputed
    once as a long tensor so a gather is one advanced index; a slice inside one run of
    physically consecutive pages is a plain slice (a view in the model dtype)."""

    def __init__(self, pool: PagePool, storage: KvRows, per_page: int, table: list[int], rows: int,
                 phys: torch.Tensor | None = None):
        if rows > len(table) * per_page:
            raise PagePoolError(f"{rows} rows need {-(-rows // per_page)} pages; the table has {len(table)}")
        self.pool, self.storage, self.per_page = pool, storage, per_page
        self.table = list(table)
        self.rows = rows
        if phys is None:
            i = torch.arange(rows)
            t = torch.tensor(self.table, dtype=torch.long) if self.table else torch.zeros(0, dtype=torch.long)
            phys = (t[i // per_page] * per_page + i % per_page).to(storage.device)
        self.phys = phys  # read-only: views of one state and ratio may share it
        # run_end[k]: the last logical page of the physically consecutive run that page k starts
        n = len(self.table)
        self._run_end = list(range(n))
        for k in range(n - 2, -1, -1):
            if self.table[k + 1] == self.table[k] + 1:
                self._run_end[k] = self._run_end[k + 1]

    # ---- KvRows interface --------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def width(self) -> int:
        return self.storage.width

    @property
    def fp8_nope(self) -> int | None:
        return self.storage.fp8_nope

    @property
    def row_bytes(self) -> int:
        return self.storage.row_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.width)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows this view addresses (shared pages count for every view using them)."""
        return self.rows * self.row_bytes

    def _span(self, index: slice) -> tuple[int, int] | None:
        """(a, b) of a step-1 slice, clipped to the rows; None for other slices."""
        if index.step not in (None, 1):
            return None
        a, b, _ = index.indices(self.rows)
        return a, max(a, b)

    def _contiguous(self, a: int, b: int) -> int | None:
        """Physical row of logical row a when rows [a, b) are physically consecutive, else None."""
        if b <= a:
            return 0
        ka, kb = a // self.per_page, (b - 1) // self.per_page
        if self._run_end[ka] < kb:
            return None
        return self.table[ka] * self.per_page + a % self.per_page

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice) and (span := self._span(index)) is not None:
            a, b = span
            base = self._contiguous(a, b)
            if base is not None:
                return self.storage[base:base + (b - a)]
            return self.storage[self.phys[a:b]]
        if isinstance(index, int):
            return self.storage[int(self.phys[index])]
        if isinstance(index, torch.Tensor) and index.dtype == torch.long:
            return self.storage[self.phys[index]]
        return self.storage[self.phys[index]]

    def __setitem__(self, index, values: torch.Tensor) -> None:
        if not isinstance(index, slice) or (span := self._span(index)) is None:
            raise TypeError("paged rows are written by step-1 slices only")
        a, b = span
        if b <= a:
            return
        self.check_writable(a, b)
        base = self._contiguous(a, b)
        if base is not None:
            self.storage[base:base + (b - a)] = values
        else:
            self.storage[self.phys[a:b]] = values

    def check_writable(self, a: int, b: int) -> None:
        """SharedPageWriteError when rows [a, b) touch a page with another holder."""
        if b <= a:
            return
        for k in range(a // self.per_page, (b - 1) // self.per_page + 1):
            page = self.table[k]
            if self.pool.refcount(page) != 1:
                raise SharedPageWriteError(
                    f"rows [{a}, {b}) fall in page {page}, which {self.pool.refcount(page)} holders reference; "
                    f"shared pages are immutable (a prefix-cache entry or another sequence reads them)")

    def clone_storage(self) -> list[torch.Tensor]:
        """Copies of the stored bytes of this view's rows (tests compare them across refusals)."""
        s = self.storage
        parts = [s.data] if s.fp8_nope is None else [s.nope, s.rope]
        return [t[self.phys].clone() for t in parts]


# ---- snapshots of paged states (both families' codecs) ------------------------------------------
def shared_tokens(state, pos: int) -> int:
    """The positions whose pool rows a snapshot without pools (blob.FLAG_NO_POOLS) at `pos` leaves
    out: its whole pages (all of them for a state without pages, which such a blob never restores
    into)."""
    pages = state.pages
    return pos if pages is None else pos // pages.page_tokens * pages.page_tokens


def check_restore_pages(state, pos: int, no_pools: bool) -> None:
    """Refusal 10 (docs/state-format.md): a blob without its whole pages' pool rows restores only
    into a state holding exactly those pages by reference; a full blob never rewrites a shared
    page, and the page the next forward writes must be this state's alone."""
    from ..errors import SnapshotPagesError
    pages = state.pages
    if no_pools:
        shared = shared_tokens(state, pos)
        if pages is None or state.prefix_tokens != shared:
            held = "no pages" if pages is None else "no prefix pages" if state.prefix_tokens == 0 else \
                f"prefix pages for positions [0, {state.prefix_tokens})"
            raise SnapshotPagesError(
                f"snapshot at pos {pos} leaves out the pool rows of its whole pages (a prefix-cache or fork "
                f"snapshot); it restores only into a state created with new_state(..., pages=pool, prefix_pages="
                f"<the pages of positions [0, {shared})>), and this state holds {held}")
        return
    if pages is None:
        return
    for page in state.page_table[:pos // pages.page_tokens + 1]:
        if pages.refcount(page) != 1:
            raise SnapshotPagesError(
                f"restoring pos {pos} would write page {page}, which {pages.refcount(page)} holders reference; "
                f"restore into a state whose pages are its own")
