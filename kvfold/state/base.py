"""What every per-sequence state shares: identity, ownership checks and the freed flag.

Model-specific states (DeepSeek-V4, GLM-5.3) add their buffers, cursors and snapshot codec. Both
can keep their growing pools in a shared `PagePool` (pages.py); the page table and its
references live here.
"""
from __future__ import annotations

import itertools

import torch

from ..errors import FreedStateError, PagePoolError, SharedPageWriteError, StateError, StateMismatchError

_kv_ids = itertools.count(1)  # one counter for every kind of state: an id is never reused in a process


def next_kv_id() -> int:
    return next(_kv_ids)


class SequenceState:
    def __init__(self, layers: list, *, capacity: int, max_rewind: int, fingerprint: str,
                 device: torch.device, dtype: torch.dtype, pages=None, page_table: list[int] | None = None,
                 prefix_tokens: int = 0, arena=None, slot: int | None = None):
        self.layers: list | None = layers
        self.capacity = capacity
        self.max_rewind = max_rewind
        self.fingerprint = fingerprint
        self.device = device
        self.dtype = dtype
        self.pos = 0
        self.kv_id = next_kv_id()
        # rows of positions [pos, written_until) were computed and are still intact: a rewound
        # verify pass can re-advance over them (sync_to) without recomputing
        self.written_until = 0
        # positions below this cannot be rewound to (their rows were never held: set by restore)
        self.rewind_floor = 0
        # paged states: the PagePool their growing pools live in, and their page table (the first
        # prefix_tokens // page_tokens pages were taken by reference from another holder)
        self.pages = pages
        self._page_table: list[int] = list(page_table or [])
        self.prefix_tokens = prefix_tokens
        # states made in a SlotArena (state/arena.py): their rings are views of slot `slot`
        self.arena, self.slot = arena, slot
        # a placed model's states (models/placed.py): each layer's device, fixed when the state is
        # made (the seed's dev_set); None for a model on one device
        self.dev_set: tuple[str, ...] | None = None

    @property
    def freed(self) -> bool:
        return self.layers is None

    def free(self) -> None:
        """Release every buffer and drop this state's page references. A second call does nothing;
        any later use raises FreedStateError."""
        if self.layers is not None and self.pages is not None:
            table, self._page_table = self._page_table, []
            self.pages.decref(table)
        if self.layers is not None and self.arena is not None:
            self.arena.release(self.slot)
        self.layers = None

    def graph_inputs(self, k: int) -> tuple[int, ...]:
        """What a graph step (engine/graphs.py) of this state's next k tokens needs to know beyond
        their positions, as ints of every one of its rows (none here; a family's state may plan)."""
        return ()

    def after_graph_step(self, k: int) -> None:
        """The cursors after k tokens whose rows a graph step (engine/graphs.py) wrote without
        host bookkeeping: the position, and the rows written."""
        self.pos = self.written_until = self.pos + k

    def start_at(self, n: int) -> None:
        """Begin a fresh state at position n, as if positions [0, n) had been fed but left nothing
        (zero rows, never rewound to): a drafter that joins a sequence late. Refused unless the
        state is fresh (pos 0) and n fits its capacity."""
        self._check_start_at(n)
        self.pos = self.written_until = self.rewind_floor = n

    def _check_start_at(self, n: int) -> None:
        self._check_alive()
        if self.pos != 0 or self.written_until != 0 or not 0 <= n <= self.capacity:
            raise StateError(f"start_at({n}) needs a fresh state (pos {self.pos}) and 0 <= n <= capacity "
                             f"{self.capacity}")

    # ---- pages -------------------------------------------------------------------------------
    @property
    def paged(self) -> bool:
        return self.pages is not None

    @property
    def page_table(self) -> list[int]:
        """The pool pages holding this state's paged rows (page j: positions [j * page_tokens,
        (j + 1) * page_tokens)); empty for a private or freed state."""
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

    def shared_page_in(self, a: int, b: int) -> int | None:
        """A page holding positions in [a, b) that another holder references, if any."""
        if self.pages is None:
            return None
        pt = self.pages.page_tokens
        for page in self._page_table[a // pt:min(-(-b // pt), len(self._page_table))]:
            if self.pages.refcount(page) > 1:
                return page
        return None

    def _check_alive(self) -> None:
        if self.layers is None:
            raise FreedStateError(f"state kv_id={self.kv_id} was freed; create a new one with model.new_state()")

    def check_usable(self, fingerprint: str, device: torch.device, dtype: torch.dtype,
                     dev_set: tuple[str, ...] | None = None) -> None:
        self._check_alive()
        if dev_set != self.dev_set:
            raise StateMismatchError(
                f"state kv_id={self.kv_id} keeps its layers on {_devices(self.dev_set, device)} but the model runs "
                f"them on {_devices(dev_set, device)}: a sequence's device-layer set is fixed when its state is "
                f"made, and no layer's state has a copy on the other side; create the state with this model's "
                f"new_state(), or snapshot() it and restore() into one")
        if fingerprint != self.fingerprint:
            raise StateMismatchError(
                f"state kv_id={self.kv_id} was made by a model with config fingerprint {self.fingerprint}, "
                f"not this one ({fingerprint}); create the state with this model's new_state()")
        if torch.device(device) != torch.device(self.device) or dtype != self.dtype:
            raise StateMismatchError(
                f"state kv_id={self.kv_id} lives on {self.device}/{self.dtype} but the model runs on "
                f"{device}/{dtype}; create the state with this model's new_state()")
        page = self.shared_page_in(self.pos, self.pos + 1)  # the page the next forward writes first
        if page is not None:  # refused before the forward writes anything
            raise SharedPageWriteError(
                f"state kv_id={self.kv_id} at pos {self.pos} would write page {page}, which other holders "
                f"reference; a state created with prefix pages must first restore the snapshot taken at their "
                f"end (pos {self.prefix_tokens})")

    def snapshot(self, pools: bool = True) -> bytes:
        """The rows still in use at `pos`, in kvfold's versioned format (docs/state-format.md).
        `pools=False` leaves out the paged pools' rows of the whole pages before pos (flag 0x100):
        the prefix cache keeps those as pages and restores such a blob only into a state holding
        them by reference."""
        self._check_alive()
        return self._encode(pools)

    def restore(self, blob: bytes) -> None:
        """Continue exactly where the snapshotted state was. Every check runs before any write;
        a refused blob raises a `SnapshotError` subclass and leaves this state unchanged."""
        self._check_alive()
        self._decode_and_apply(blob)

    def _encode(self, pools: bool = True) -> bytes:  # the model-specific snapshot codec
        raise NotImplementedError

    def _decode_and_apply(self, blob: bytes) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of buffers held (0 once freed)."""
        return 0 if self.layers is None else sum(layer.nbytes for layer in self.layers)

    def __repr__(self) -> str:
        status = "freed" if self.freed else f"pos={self.pos}/{self.capacity}"
        return f"{type(self).__name__}(kv_id={self.kv_id}, {status}, max_rewind={self.max_rewind})"


def _devices(dev_set: tuple[str, ...] | None, device) -> str:
    """A device-layer set in words: 'cuda:0 (layers 0-3), cpu (layers 4-7)'."""
    if dev_set is None:
        return f"{device} (every layer)"
    runs: list[list] = []
    for i, d in enumerate(dev_set):
        if runs and runs[-1][0] == d:
            runs[-1][2] = i
        else:
            runs.append([d, i, i])
    return ", ".join(f"{d} (layers {a}-{b})" if a != b else f"{d} (layer {a})" for d, a, b in runs)
