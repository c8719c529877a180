"""Decode state at fixed addresses: the slots a captured CUDA graph reads and writes.

A captured graph replays its kernels on the tensors it was captured with, at their addresses.
States allocated one by one as requests come and go would need a graph per set of sequences.
So an arena preallocates each ring of `slots` sequences as ONE tensor [slots + 1, rows, width].
A state made in the arena (`model.new_state(..., arena=arena)`) holds views of its slot
(`PositionRing.over`): the per-op forward, snapshots and restores work on it unchanged, and a
graph reaches the same memory by slot number.

Compressed pools stay in the shared `PagePool`. A graph reads them through `tables`, one
device tensor holding every slot's page table, padded with the arena's scratch page. Slot
`slots` is the scratch slot. The padded rows of a batch bucket run there, and the pool writes a
step masks off land in the scratch page. Nothing else reads either.

Nothing in an arena ever moves. `tensors()` lists what a graph captures, so a caller can check
before each replay that it is still what the graph was captured on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import CapacityError, ConfigError, StateMismatchError
from .pages import PagePool
from .rings import PositionRing


class ArenaFullError(CapacityError):
    """Every slot of the arena holds a live state."""


@dataclass(frozen=True)
class RingSpec:
    """One ring of every slot: `rows` x `width` values of `dtype`, filled with `fill` when a slot is taken."""
    key: tuple
    rows: int
    width: int
    dtype: torch.dtype
    fill: float = 0.0


class SlotArena:
    holds_every_layer = True  # buffers of every layer: never tagged whole with one layer's device

    def __init__(self, specs: list[RingSpec], slots: int, pages: PagePool, *, capacity: int, max_rewind: int,
                 fingerprint: str):
        """Rings of `slots` states of up to `capacity` tokens, their pools in `pages` (one page of
        it becomes the scratch page)."""
        if slots < 1 or capacity < 1:
            raise ConfigError(f"an arena needs slots >= 1 and capacity >= 1 (got {slots}, {capacity})")
        self.slots, self.capacity, self.max_rewind = slots, capacity, max_rewind
        self.fingerprint, self.pages, self.device = fingerprint, pages, pages.device
        self.specs = {s.key: s for s in specs}
        self.rings = {s.key: torch.full((slots + 1, s.rows, s.width), s.fill, dtype=s.dtype, device=self.device)
                      for s in specs}
        self.scratch_page = pages.allocate(1)[0]
        self.max_pages = pages.pages_for(capacity)
        self.tables = torch.full((slots + 1, self.max_pages), self.scratch_page, dtype=torch.long,
                                 device=self.device)
        self._free = list(range(slots - 1, -1, -1))  # a stack: slot 0 first
        self.holders: list = [None] * slots

    @property
    def scratch(self) -> int:
        """The slot no state holds (padded rows of a bucket run there)."""
        return self.slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check_fits(self, capacity: int, max_rewind: int, pages: PagePool | None, fingerprint: str) -> None:
        """Refuse (changing nothing) a state this arena cannot hold."""
        if pages is not self.pages:
            raise StateMismatchError("a state in an arena keeps its pools in the arena's PagePool; "
                                     "pass new_state(..., pages=arena.pages)")
        if fingerprint != self.fingerprint:
            raise StateMismatchError(f"this arena holds states of {self.fingerprint}, not {fingerprint}")
        if capacity > self.capacity or max_rewind != self.max_rewind:
            raise CapacityError(f"the arena holds states of capacity <= {self.capacity} and max_rewind "
                                f"{self.max_rewind}; got capacity {capacity}, max_rewind {max_rewind}")
        if not self._free:
            raise ArenaFullError(f"all {self.slots} slots of the arena hold live states; free one first")

    def take(self) -> int:
        """A free slot, its rings refilled as a new state's are (call `check_fits` first)."""
        slot = self._free.pop()
        for key, ring in self.rings.items():
            ring[slot].fill_(self.specs[key].fill)
        return slot

    def ring(self, key: tuple, slot: int) -> PositionRing:
        """The ring `key` of `slot`, as a view."""
        return PositionRing.over(self.rings[key][slot])

    def buffer(self, key: tuple, slot: int) -> torch.Tensor:
        """The buffer `key` of `slot` [rows, width], as a view (state that is no position ring)."""
        return self.rings[key][slot]

    def bind(self, slot: int, state) -> None:
        """`state` holds `slot` now: its page table goes to the device table."""
        self.holders[slot] = state
        table = state.page_table
        if table:
            self.tables[slot, :len(table)] = torch.tensor(table, dtype=torch.long, device=self.device)

    def release(self, slot: int) -> None:
        """The state of `slot` was freed: the slot is free again."""
        if self.holders[slot] is None and slot in self._free:
            return
        self.holders[slot] = None
        self.tables[slot].fill_(self.scratch_page)
        self._free.append(slot)

    def tensors(self) -> list[torch.Tensor]:
        """Everything of the arena's a graph reads or writes: its rings, the page tables and the
        pool storages."""
        pools = [t for rows in self.pages.storages.values()
                 for t in ((rows.data,) if rows.fp8_nope is None else (rows.nope, rows.rope))]
        return [*self.rings.values(), self.tables, *pools]


@dataclass
class ArenaRows:
    """What every layer of one graph-decode step reads: the rows' positions and slots, their page
    tables, and the bound `context` on every position + 1 that fixes the step's shapes."""
    arena: SlotArena
    positions: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long
    context: int
    tables: torch.Tensor = field(init=False)  # [N, max_pages] long

    def __post_init__(self):
        self.tables = self.arena.tables.index_select(0, self.slots)

    def pool(self, layer: int, kind: str, ratio: int) -> tuple[torch.Tensor, int]:
        """(storage [pool rows, width], rows per page) of a layer pool."""
        pages = self.arena.pages
        return pages.storages[(layer, kind)].data, pages.rows_per_page(ratio)

    def entry_rows(self, entries: torch.Tensor, per: int) -> torch.Tensor:
        """Physical pool row of each entry [N, E] of each row's sequence."""
        return self.tables.gather(1, entries // per) * per + entries % per

    def n_entries(self, ratio: int, per: int) -> int:
        """Pool entries a row of this step may see: those of positions below `context`."""
        return min(self.arena.max_pages * per, -(-self.context // ratio))

    def scratch_row(self, per: int) -> int:
        """A pool row of the scratch page: where a step's masked-off pool writes land."""
        return self.arena.scratch_page * per

