"""Per-sequence indexer cache of one GLM-5.3 (`glm5_next`) DSA layer: the per-token indexer keys,
gates and validity that k-pool selection (dsa_select.py) reads.

One sequence x one *full* DSA layer. Three flat buffers, allocated once (zeroed) at `capacity`
rows and never grown:

    k_normed [capacity, d]  indexer keys after the k_norm LayerNorm   (model dtype, bf16 default;
                            float8_e4m3fn at unit scale in an FP8 KV state, `key_dtype`)
    gate     [capacity, d]  compress-gate projection G.x              (model dtype)
    valid    [capacity]     u8, 1 unless the row is padding

FP8 keys (`key_dtype=torch.float8_e4m3fn`, a state made with `kv_dtype="fp8"`) are stored clamped to
+-448 and read back decoded, exactly, into the model dtype (`readable()`); the gates stay in the
model dtype: they are softmax logits, where FP8's relative step of 1/16 would move a pool slot's
weight by |gate|/16, several percent for logits of order one.

Rows [0, len) are reachable; the selector reads only those. Rows at or past `len` may still hold
old data (a rewound draft) but the next write overwrites them before anything selects over them.
The buffers are flat, not paged, because selection reads rows at absolute positions.

Every method that refuses raises one of kvfold's generic errors (`CapacityError`, `RewindError`,
`FreedStateError`, `StateMismatchError`, `ConfigError`, a `SnapshotError` subclass for a refused
blob, `StateError` for a malformed call) and changes neither `len` nor any buffer.

The blob (`snapshot_blob` / `restore_blob`) is the one serialisation of these rows: a GLM-5.3
state snapshot (state.py) embeds one per full DSA layer. Layout and refusal order are in
docs/state-format.md.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ...errors import (CapacityError, ConfigError, FreedStateError, RewindError, SnapshotCapacityError,
                      SnapshotModelError, SnapshotSizeError, SnapshotTruncatedError, StateError,
                      StateMismatchError)
from ...numerics.quant import e4m3_saturate
from .dsa_select import dsa_pool_keys

BLOB_HEADER = struct.Struct("<QQ")  # len, index_head_dim: u64 little-endian each
KV_FP8 = torch.float8_e4m3fn  # what kv_dtype="fp8" stores: MLA latent rows and indexer keys


_MAX_TOPK_TILE = 2048  # largest power of two T with 16*T <= 49,152 B of shared memory (one top-k tile)


@dataclass(frozen=True)
class Glm5NextDsaConfig:
    """The indexer fields of a glm5_next config that the state and its selection plan need.

    Defaults are GLM-5.3-Flash's (index_kpool 4 comes from its config.json; HF's class default
    is 16, so always read it from the checkpoint's config)."""
    index_head_dim: int = 128
    index_heads: int = 32
    index_topk: int = 2048
    index_kpool: int = 4
    always_select_tail: bool = True
    max_context: int = 16384  # the max-seq-len setting; sizes every indexer state

    def problems(self) -> list[str]:
        """Why this config cannot run (empty when it can). HF's validate_architecture rules."""
        out = []
        if self.index_kpool < 1:
            out.append(f"index_kpool must be >= 1, got {self.index_kpool}")
        elif self.index_topk % self.index_kpool != 0:
            out.append(f"index_topk ({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})")
        if self.index_topk < 1:
            out.append(f"index_topk must be >= 1, got {self.index_topk}")
        if self.index_head_dim < 1 or self.index_heads < 1:
            out.append(f"index_head_dim and index_heads must be >= 1, got {self.index_head_dim}, "
                       f"{self.index_heads}")
        return out


@dataclass(frozen=True)
class DsaSelectGeometry:
    """Plan of one selection over the `seq` cached rows for the last `q_rows` of them."""
    seq: int
    q_rows: int
    n_pools_full: int  # ceil(seq / kp): pools including a partial trailing one
    n_pools: int  # floor(seq / kp): complete pools only, the selection candidates
    select_k: int  # min(topk / kp, n_pools) pools picked per query
    out_width: int  # topk + kp - 1 with the tail, else topk
    topk_np2: int  # one top-k tile: min(max(next_pow2(n_pools), 2), 2048)
    topk_smem: int  # 16 * topk_np2 bytes
    index_head_dim: int
    index_heads: int
    index_kpool: int


def dsa_capacity(max_context: int, index_kpool: int) -> int:
    """Rows reserved: max_context rounded DOWN to whole k-pools (kp 0 treated as 1).
    E.g. 16386 -> 16384 at kp 4; 1001 -> 1000 at kp 8."""
    kp = max(index_kpool, 1)
    return (max(max_context, 0) // kp) * kp


def _row_bytes(index_head_dim: int, dtype: torch.dtype, key_dtype: torch.dtype | None) -> int:
    """Bytes per row: a key row (in key_dtype, default dtype), a gate row (dtype), a validity byte."""
    return index_head_dim * ((key_dtype or dtype).itemsize + dtype.itemsize) + 1


def indexer_state_bytes(capacity: int, index_head_dim: int, dtype: torch.dtype = torch.bfloat16,
                        key_dtype: torch.dtype | None = None, index_kpool: int = 0) -> int:
    """Bytes one state holds: two [capacity, d] row buffers plus one validity byte per row
    (capacity * (4d + 1) in bf16, i.e. 513 B per token at d = 128; with FP8 keys 385 B), and,
    with `index_kpool` kp > 0, the pooled keys of complete pools (`pool_cache_bytes`)."""
    return capacity * _row_bytes(index_head_dim, dtype, key_dtype) + pool_cache_bytes(capacity, index_head_dim, dtype,
                                                                                      index_kpool)


def pool_cache_bytes(capacity: int, index_head_dim: int, dtype: torch.dtype, index_kpool: int) -> int:
    """The pooled-key cache of a state (`Glm5NextDsaState.pooled`): per k-pool a key row in the
    state dtype and a validity byte (capacity / kp * (2d + 1) in bf16); none for kp 0."""
    return 0 if index_kpool < 1 else capacity // index_kpool * (index_head_dim * dtype.itemsize + 1)


def dsa_blob_bytes(rows: int, index_head_dim: int, dtype: torch.dtype = torch.bfloat16,
                   key_dtype: torch.dtype | None = None) -> int:
    """Bytes of `snapshot_blob` at len `rows`: the 16-byte header plus two [rows, d] row blocks
    and one validity byte per row (16 + 513 * rows in bf16 at d = 128; 16 + 385 * rows with FP8
    keys)."""
    return BLOB_HEADER.size + rows * _row_bytes(index_head_dim, dtype, key_dtype)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class Glm5NextDsaState:
    """Indexer rows of one sequence for one full DSA layer. See the module docstring."""

    def __init__(self, max_context: int, index_head_dim: int, index_kpool: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 key_dtype: torch.dtype | None = None):
        if index_head_dim < 1:
            raise ConfigError(f"index_head_dim must be >= 1, got {index_head_dim}")
        if key_dtype not in (None, dtype, KV_FP8):
            raise ConfigError(f"indexer keys are stored in the state dtype ({dtype}) or {KV_FP8}, "
                              f"not {key_dtype}")
        self._capacity = dsa_capacity(max_context, index_kpool)
        self._d = index_head_dim
        self.dtype = dtype
        self.key_dtype = key_dtype or dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._len = 0
        self._released = False
        self._k_normed: torch.Tensor | None = torch.zeros(self._capacity, index_head_dim, dtype=self.key_dtype,
                                                          device=self.device)
        self._gate: torch.Tensor | None = torch.zeros(self._capacity, index_head_dim, dtype=dtype, device=self.device)
        self._valid: torch.Tensor | None = torch.zeros(self._capacity, dtype=torch.uint8, device=self.device)
        # derived from the rows, never snapshotted: the pooled keys of the complete pools, so a
        # decode step pools only the rows new since the last one (`pooled`)
        self._kp = max(index_kpool, 1)
        self._pool_keys: torch.Tensor | None = torch.zeros(self._capacity // self._kp, index_head_dim, dtype=dtype,
                                                           device=self.device)
        self._pool_ok: torch.Tensor | None = torch.zeros(self._capacity // self._kp, dtype=torch.bool,
                                                         device=self.device)
        self._pooled = 0  # pools [0, _pooled) of `_pooled_for` hold their keys
        self._pooled_for: tuple | None = None  # (first valid row, the ape they were pooled with)

    @classmethod
    def over(cls, max_context: int, index_kpool: int, k_normed: torch.Tensor, gate: torch.Tensor,
             valid: torch.Tensor) -> Glm5NextDsaState:
        """A state whose rows live in buffers owned elsewhere (a slot of a `SlotArena`): k_normed
        and gate [rows, d] of the state dtype, valid [rows] uint8, zeroed, rows >= the capacity."""
        st = cls.__new__(cls)
        st._capacity, st._d = dsa_capacity(max_context, index_kpool), k_normed.shape[1]
        st.dtype = st.key_dtype = gate.dtype
        st.device = gate.device
        st._len, st._released = 0, False
        st._k_normed, st._gate, st._valid = (t[:st._capacity] for t in (k_normed, gate, valid))
        st._kp, st._pool_keys, st._pool_ok, st._pooled, st._pooled_for = max(index_kpool, 1), None, None, 0, None
        return st  # (no pooled-key cache: a graph step pools every row it reads)

    @classmethod
    def alloc(cls, cfg: Glm5NextDsaConfig, *, dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str | None = None, key_dtype: torch.dtype | None = None) -> Glm5NextDsaState:
        """Reserve for the whole addressable context: the cap, not the prompt, sizes the state
        (the MTP drafter allocates its own with the same cap)."""
        return cls(cfg.max_context, cfg.index_head_dim, cfg.index_kpool, dtype=dtype, device=device,
                   key_dtype=key_dtype)

    # ---- read-only ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    @property
    def len(self) -> int:
        """Reachable rows (0 once freed)."""
        return self._len

    def is_empty(self) -> bool:
        return self._len == 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def index_head_dim(self) -> int:
        """Indexer key width; restore_blob refuses a blob taken at another width."""
        return self._d

    @property
    def released(self) -> bool:
        return self._released

    @property
    def fp8_keys(self) -> bool:
        return self.key_dtype == KV_FP8

    @property
    def nbytes(self) -> int:
        """Bytes of buffers held (0 once freed)."""
        return 0 if self._released else indexer_state_bytes(
            self._capacity, self._d, self.dtype, self.key_dtype, self._kp if self._pool_keys is not None else 0)

    def row_offset(self, pos: int) -> int:
        """Byte offset of row `pos` in gate, and in k_normed when the keys are in the state dtype
        (pos * d * 2 in bf16); FP8 keys: `key_row_offset`."""
        return pos * self._d * self.dtype.itemsize

    def key_row_offset(self, pos: int) -> int:
        """Byte offset of row `pos` in k_normed (pos * d with FP8 keys)."""
        return pos * self._d * self.key_dtype.itemsize

    @property
    def k_normed(self) -> torch.Tensor:
        self._check_alive()
        return self._k_normed

    @property
    def gate(self) -> torch.Tensor:
        self._check_alive()
        return self._gate

    @property
    def valid(self) -> torch.Tensor:
        self._check_alive()
        return self._valid

    def reachable(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of rows [0, len) of k_normed, gate and valid, as stored."""
        self._check_alive()
        n = self._len
        return self._k_normed[:n], self._gate[:n], self._valid[:n]

    def readable(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [0, len) as the selector reads them: `reachable()` with FP8 keys decoded into the
        state dtype (exact: every float8_e4m3fn value is a bf16 and an fp32 value)."""
        k, gate, valid = self.reachable()
        return (k if k.dtype == self.dtype else k.to(self.dtype)), gate, valid

    # ---- room checks (never mutate) -----------------------------------------------------------
    def ensure_room_through(self, end: int) -> None:
        """Refuse when absolute end row `end` passes capacity; end == capacity is fine.

        Used before a graph replay, when the counter may still be ahead of the sequence, with
        end = seq_len + k."""
        self._check_alive()
        if end > self._capacity:
            raise CapacityError(
                f"DSA indexer state needs rows up to {end} but holds {self._capacity} "
                f"(max_context rounded down to whole k-pools); raise the max-seq-len setting (max_context)")

    def ensure_room(self, n: int) -> None:
        """Refuse when n more rows would pass capacity. The indexer forward writes row `len`
        before it advances, so it calls this first: at len == capacity that row is past the end."""
        self._check_count("ensure_room", n)
        self.ensure_room_through(self._len + n)

    # ---- cursor -------------------------------------------------------------------------------
    def write_rows(self, start: int, k_normed: torch.Tensor, gate: torch.Tensor,
                   valid: torch.Tensor | None = None) -> None:
        """Write rows [start, start + n) of k_normed and gate ([n, d] each, cast to the state's
        dtype; keys to FP8, saturated, in an FP8-key state) and their validity (default 1: not
        padding). Does not move `len`: call
        `advance(n)` after writing at `len`, or `sync_to` after a replay that wrote at seq_len.

        `start` may be below `len` (a replay over a rejected draft) but not above it, since the
        rows in between would become reachable without ever being written."""
        self._check_alive()
        n = k_normed.shape[0]
        if k_normed.shape != (n, self._d) or gate.shape != (n, self._d):
            raise StateError(f"write_rows wants k_normed and gate of shape [n, {self._d}], got "
                             f"{tuple(k_normed.shape)} and {tuple(gate.shape)}")
        if valid is not None and valid.shape != (n,):
            raise StateError(f"write_rows wants valid of shape [{n}], got {tuple(valid.shape)}")
        if start < 0 or start > self._len:
            raise StateError(f"write_rows at row {start} would leave a gap: rows are written at or "
                             f"below len ({self._len})")
        self.ensure_room_through(start + n)
        end = start + n
        self._forget_pools_from(start)
        keys = k_normed.to(device=self.device)
        self._k_normed[start:end] = e4m3_saturate(keys) if self.fp8_keys else keys.to(self.dtype)
        self._gate[start:end] = gate.to(device=self.device, dtype=self.dtype)
        if valid is None:
            self._valid[start:end] = 1
        else:
            self._valid[start:end] = (valid.to(self.device) != 0).to(torch.uint8)

    def advance(self, n: int) -> None:
        """Expose n rows written at [len, len + n). Refused, len unchanged, past capacity."""
        self._check_count("advance", n)
        self.ensure_room(n)
        self._len += n

    def rewind_to(self, n: int) -> None:
        """Undo rows past n (a rejected speculative draft). Only shrinks: rows [n, len) stay in
        memory but are unreachable, and the next write starts at n so it overwrites them."""
        self._check_alive()
        if n > self._len:
            raise RewindError(f"rewind_to({n}) with len {self._len}: rewind only shrinks; growing is "
                              f"advance's job, so the caller has lost track of the sequence")
        if n < 0:
            raise RewindError(f"rewind_to({n}): a row count cannot be negative")
        self._len = n

    def sync_to(self, seq_len: int, k: int) -> None:
        """Put the counter where decode would have left it after a step whose k rows at seq_len
        were written without host bookkeeping (a graph replay): rewind to seq_len if ahead
        (a rejected draft), refuse if behind (rows are missing), then advance by k.

        Every check runs before the rewind, so a refusal leaves len unchanged."""
        self._check_count("sync_to", k)
        if seq_len < 0:
            raise RewindError(f"sync_to({seq_len}, {k}): a sequence length cannot be negative")
        if self._len < seq_len:
            raise RewindError(f"sync_to({seq_len}, {k}): state is behind (len {self._len}), rows are "
                              f"missing; run the indexer over positions [{self._len}, {seq_len}) first")
        self.ensure_room_through(seq_len + k)
        self._len = seq_len + k

    # ---- pooled keys --------------------------------------------------------------------------
    def pooled(self, ape: torch.Tensor, kpool: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`dsa_pool_keys` of rows [0, len) (keys [P, d], rows [P, kp], pool_valid [P]), the complete
        pools' keys kept from call to call: a pool's key depends on its own kp rows only, so the
        pools complete at the last call are not pooled again (a decode step pools at most one).
        Pools past the complete ones are invalid, as dsa_pool_keys has them, and their keys are
        never read. Rows rewritten (`write_rows` below a pool's end) or restored drop the pools
        they touch."""
        if self._pool_keys is None or kpool != self._kp:
            return None  # (a graph step's slot, or another pool size: the selector pools every row)
        k, gate, valid = self.reachable()  # keys as stored: only the new pools' rows are decoded below
        n = self._len
        is_valid = valid != 0
        first = int(is_valid.to(torch.uint8).argmax()) if bool(is_valid.any()) else n  # the selector's `first`
        key = (first, ape.data_ptr())
        if key != self._pooled_for:
            self._pooled, self._pooled_for = 0, key
        complete = (n - first) // kpool
        if self._pooled < complete:
            a, b = first + self._pooled * kpool, first + complete * kpool
            zero = torch.zeros(1, dtype=torch.long, device=k.device)
            new_k = k[a:b] if k.dtype == self.dtype else k[a:b].to(self.dtype)  # (readable()'s decode)
            keys, _, ok = dsa_pool_keys(new_k[None], gate[a:b][None], valid[a:b][None], ape, kpool,
                                        seq=torch.full((1,), b - a, dtype=torch.long, device=k.device), first=zero)
            self._pool_keys[self._pooled:complete], self._pool_ok[self._pooled:complete] = keys[0], ok[0]
            self._pooled = complete
        n_pools = n // kpool
        pool_valid = torch.zeros(n_pools, dtype=torch.bool, device=k.device)
        pool_valid[:complete] = self._pool_ok[:complete]
        rows = first + torch.arange(n_pools * kpool, device=k.device).view(n_pools, kpool)
        return self._pool_keys[:n_pools], rows, pool_valid

    def _forget_pools_from(self, row: int) -> None:
        """Rows from `row` on change: the cached pools that hold any of them are dropped."""
        if self._pooled_for is not None:
            self._pooled = max(0, min(self._pooled, (row - self._pooled_for[0]) // self._kp))

    # ---- selection plan -----------------------------------------------------------------------
    def geometry(self, cfg: Glm5NextDsaConfig, q_rows: int) -> DsaSelectGeometry:
        """Plan a selection over everything cached so far (seq = len) for the last q_rows rows.

        Refused when the config is invalid (or of another index_head_dim than this state),
        q_rows is 0 or more than seq, seq is 0, or select_k does not fit one top-k tile: an invalid
        config (or select_k over one tile) is a ConfigError, a config of another width alone a
        StateMismatchError, an empty state or q_rows out of range a StateError."""
        self._check_alive()
        problems = cfg.problems()
        invalid = bool(problems)
        if cfg.index_head_dim != self._d:
            problems.append(f"index_head_dim {cfg.index_head_dim} differs from this state's {self._d}")
        if problems:
            raise (ConfigError if invalid else StateMismatchError)(
                "invalid DSA indexer config: " + "; ".join(problems))
        seq, kp = self._len, cfg.index_kpool
        if seq == 0:
            raise StateError("geometry over an empty DSA state: write and advance rows first")
        if q_rows < 1 or q_rows > seq:
            raise StateError(f"geometry wants 1 <= q_rows <= seq ({seq}), got q_rows {q_rows}")
        n_pools = seq // kp
        select_k = min(cfg.index_topk // kp, n_pools)
        topk_np2 = min(max(_next_pow2(n_pools), 2), _MAX_TOPK_TILE)
        if select_k > topk_np2:
            raise ConfigError(f"select_k {select_k} exceeds one top-k tile ({topk_np2} pools); "
                              f"index_topk / index_kpool must be <= {_MAX_TOPK_TILE}")
        return DsaSelectGeometry(
            seq=seq, q_rows=q_rows, n_pools_full=-(-seq // kp), n_pools=n_pools, select_k=select_k,
            out_width=cfg.index_topk + (kp - 1 if cfg.always_select_tail else 0),
            topk_np2=topk_np2, topk_smem=16 * topk_np2, index_head_dim=cfg.index_head_dim,
            index_heads=cfg.index_heads, index_kpool=kp)

    # ---- blob: prefix-cache and snapshot form of rows [0, len) --------------------------------
    def snapshot_blob(self) -> bytes:
        """Rows [0, len): 16-byte header (len u64 LE, index_head_dim u64 LE), then key rows (raw,
        row-major, in the key dtype), gate rows (in the state's dtype) and validity bytes. The size,
        16 + len * (4d + 1) in bf16 (16 + len * (3d + 1) with FP8 keys), does not depend on
        capacity."""
        self._check_alive()
        n = self._len
        parts = [BLOB_HEADER.pack(n, self._d)]
        for buf in (self._k_normed, self._gate, self._valid):
            parts.append(_raw_bytes(buf[:n]))
        return b"".join(parts)

    def check_blob(self, blob: bytes) -> int:
        """Run every check restore_blob runs, in its order, and write nothing; return the blob's
        len. A GLM-5.3 state snapshot checks all its DSA layers' blobs this way before it
        restores any of them, so a refusal in a later layer leaves earlier layers unchanged too.

        Refusals, in order: truncated (`SnapshotTruncatedError`), other width
        (`SnapshotModelError`), size mismatch (`SnapshotSizeError`), over capacity
        (`SnapshotCapacityError`)."""
        self._check_alive()
        if len(blob) < BLOB_HEADER.size:
            raise SnapshotTruncatedError(f"DSA indexer blob of {len(blob)} bytes is shorter than its "
                                         f"{BLOB_HEADER.size}-byte header")
        rows, width = BLOB_HEADER.unpack_from(blob)
        # width before size: two (len, d) pairs can give the same byte count
        if width != self._d:
            raise SnapshotModelError(f"DSA indexer blob has index_head_dim {width}, this state {self._d}: "
                                     f"it was taken from another model")
        expected = dsa_blob_bytes(rows, self._d, self.dtype, self.key_dtype)
        if len(blob) != expected:
            raise SnapshotSizeError(f"DSA indexer blob is {len(blob)} bytes but its header (len {rows}, "
                                    f"d {width}) implies {expected}: {self._size_cause(len(blob), rows)}")
        if rows > self._capacity:
            raise SnapshotCapacityError(
                f"DSA indexer blob holds {rows} rows but this state reserves {self._capacity}; raise the "
                f"max-seq-len setting (max_context) to at least {rows}")
        return rows

    def restore_blob(self, blob: bytes) -> None:
        """Replace rows [0, L) and len with a snapshot's. Checks (`check_blob`), all before any
        write and in this order: truncated, other width, size mismatch, over capacity. A blob too
        long for this state is refused, not clamped: selecting over a prefix while the MLA cache
        holds the whole context would be silently wrong."""
        blob = bytes(blob)
        rows = self.check_blob(blob)
        at = BLOB_HEADER.size
        for buf, size in ((self._k_normed, self.key_row_offset(rows)), (self._gate, self.row_offset(rows)),
                          (self._valid, rows)):
            if rows:
                _copy_raw(blob[at:at + size], buf[:rows])
            at += size
        self._len = rows
        self._pooled = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    def free(self) -> None:
        """Release the buffers. Idempotent (`released` is set first): both the layer's release
        and the MTP proposer can reach one state. Afterwards len is 0 and use raises."""
        if self._released:
            return
        self._released = True
        self._k_normed = self._gate = self._valid = self._pool_keys = self._pool_ok = None
        self._len = 0

    def _size_cause(self, size: int, rows: int) -> str:
        """Why a blob has another byte count: taken with the other key storage (the sizes differ by
        len * d * (itemsize - 1)), else cut short or corrupted."""
        other = self.dtype if self.fp8_keys else KV_FP8
        if rows and size == dsa_blob_bytes(rows, self._d, self.dtype, other):
            want = "kv_dtype='fp8'" if other == KV_FP8 else "the default kv_dtype"
            return (f"it holds keys in {other}, this state in {self.key_dtype}; restore it into a state made with "
                    f"new_state(..., {want})")
        return "it is cut short or corrupted"

    def _check_alive(self) -> None:
        if self._released:
            raise FreedStateError("this DSA indexer state was freed; allocate a new one")

    def _check_count(self, what: str, n: int) -> None:
        self._check_alive()
        if n < 0:
            raise StateError(f"{what}({n}): a row count cannot be negative; use rewind_to to shrink")

    def __repr__(self) -> str:
        status = "freed" if self._released else f"len={self._len}/{self._capacity}"
        keys = ", fp8 keys" if self.fp8_keys else ""
        return f"Glm5NextDsaState({status}, d={self._d}, {self.dtype}{keys})"


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's in-memory bytes, row-major (little-endian on every platform torch runs on)."""
    if t.numel() == 0:
        return b""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _copy_raw(data: bytes, dst: torch.Tensor) -> None:
    """Copy raw row-major bytes into dst (same dtype and shape as they were taken from)."""
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dst.dtype).view(dst.shape)
    dst.copy_(src)
