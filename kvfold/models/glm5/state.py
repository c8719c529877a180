"""Per-sequence state of a GLM-5.3 (`glm5_next`) model: preallocated, addressed by position.

Per layer:
* KDA layer: ONE state, the conv state (pre-conv inputs of the K-1 tokens before it, [K-1, 3C],
  model dtype) and the recurrent state S ([H, dk, dv], fp32) at the **base** position `kda_base`,
  plus, when max_rewind > 0, what the recurrence consumed per token since the base: k and g
  ([H, dk] fp32), v ([H, dv]) in the model dtype (the conv's model-dtype output cast to fp32, so the
  cast back is exact) and beta ([H] fp32: a sigmoid computed in fp32, which the model dtype would
  round, and then a replay would not see the forward's values), in a ring of `max_rewind` slots, and the pre-conv rows [3C] of
  the last `max_rewind + K - 1` tokens (ring `mixed`). The state at any held position n (pos after
  a rewind, the start of the next forward, a snapshot) is replayed from the base: the recurrence
  runs `kda_chunked` over the stored inputs, chunk by chunk, and the conv state is copied from the
  stored rows. Nothing re-runs a projection.

  Why the replay is bit-identical by construction: a forward runs `kda_chunked` with the chunk
  starts of `kda_chunk_starts` (kda.py): every 64 tokens from the call's first token, and at every
  one of its last max_rewind tokens. A chunk's result depends only on its tokens' (k, v, g, beta)
  and the state at its start. The state records the chunk starts after the base (`kda_cuts`, the
  base first) and replays chunk by chunk with `kda_chunked` itself, on fresh copies of equal
  tensors, so each replayed chunk is the forward's own. Every position a rewind may return to,
  [written_until - max_rewind, written_until], is a chunk start (the last max_rewind tokens of a
  call run one per chunk, and a call shorter than that follows positions that did too), so the
  state at n is the state the forward itself had at n: the bits of a state that ran the same calls
  without the tokens after n. Nothing of a rejected token is read. The only assumption is that a
  torch op given equal inputs computes equal outputs, which every bit-exact check here rests on;
  nothing depends on how two different computations round. (A verify call of max_rewind + 1
  tokens therefore runs its recurrence one token per chunk, as decode does. Whether a shorter call
  would reproduce the accepted tokens' inputs is the forward's business: a deeper layer's inputs
  come from what the verify call computed for those rows, and the DSA indexer's gate matmul gives
  no by-construction guarantee that those match a shorter call's in every bit.)

  The base is the chunk start written_until - max_rewind (or, after a rewind followed by a short
  forward, the old base where that is higher): the state holds the inputs of at most max_rewind
  tokens. Memory per KDA layer: H*dk*dv*4 + (K-1)*3C*e (the state) + max_rewind*(2*C*4 + C*e +
  H*e) + (max_rewind + K-1)*3C*e, C = H*dk, e = itemsize. GLM-5.3-Flash (34 KDA layers, 64 x 128 x
  128, K 4, bf16): 4,341,760 B per layer for the state (140.8 MiB for the model, the whole cost at
  max_rewind 0), 82,048 B per held token and 49,152 B per conv row: max_rewind 4 costs 162.6 MiB
  per sequence, max_rewind 8 179.6 MiB (one state per rewindable position cost 703.9 and
  1267.0 MiB). The price is compute: each forward replays the tokens between the base and its
  start (up to max_rewind single-token chunks), and a call's last max_rewind tokens run one per
  chunk.
* DSA layer: the MLA latent rows [capacity, kv_lora] (model dtype), prefix-shaped, row p = token p.
* Full DSA layer: additionally one `Glm5NextDsaState` (indexer keys, gates, validity), whose
  `len` tracks `pos`. It is allocated with capacity rounded *up* to whole k-pools so it never
  refuses a position below the state's capacity.
* FP8 KV (`new_state(kv_dtype="fp8")`, `kv_fp8`): the latent rows and the indexer keys are
  float8_e4m3fn at unit scale, everything else as above.

MLA latent and DSA rows rewind by cursor: rows past `pos` are unreachable and overwritten later.

Snapshots (`snapshot()` / `restore()`, docs/state-format.md): the shared framing of
kvfold/state/blob.py with magic b"KVFGLM5S", version 2; 64-byte header (magic, version, flags,
fingerprint, dtype, n_sections, pos, body_len, reserved), a 32-byte entry per section (layer, kind,
first, rows, width, dtype), the body (each section's rows, row-major) and a SHA-256 trailer. Header
flag 0x1 marks an FP8 KV state (latent sections then hold the raw float8_e4m3fn rows, and each
indexer blob FP8 key rows); a blob restores only into a state of the same KV storage.
Sections at pos: per KDA layer its conv and recurrent state at pos (replayed from the base: the
layout does not depend on max_rewind, so the format is unchanged); per DSA layer the latent rows
[0, pos); per full DSA layer one u8 section holding that layer's `Glm5NextDsaState.snapshot_blob()`
at len pos, byte for byte. Refusals, in this order, before any write: truncated, magic, version
(and unknown flags), model fingerprint, KV storage and dtype, section table vs pos, body size, checksum, capacity;
then each DSA layer's blob through `check_blob` (truncated, width, size, capacity). A refused
restore changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import RewindError
from ...numerics.backend import Backend
from ...state import blob
from ...state.blob import DTYPE_CODES, Section
from ...state.pages import check_restore_pages, shared_tokens
from ...state.base import SequenceState
from .indexer_state import Glm5NextDsaState, dsa_blob_bytes
from .kda import kda_chunk_starts, kda_chunked


def kda_ring_sizes(max_rewind: int, conv_kernel: int) -> tuple[int, int]:
    """(n_in, n_mix): slots of the per-token recurrence inputs and of the pre-conv rows a KDA layer
    holds for rewinding up to max_rewind tokens (this module's docstring: every position a rewind may return to
    is a chunk start, so the base sits max_rewind tokens below the last one written)."""
    if max_rewind == 0:
        return 0, 0
    return max_rewind, max_rewind + conv_kernel - 1


@dataclass
class KdaLayerState:
    conv: torch.Tensor  # [K-1, 3C], model dtype: the conv state at the base
    rec: torch.Tensor  # [H, dk, dv], fp32: the recurrent state at the base
    k: torch.Tensor  # [n_in, H, dk] fp32, slot p % n_in: position p's inputs of the recurrence
    g: torch.Tensor  # [n_in, H, dk] fp32
    v: torch.Tensor  # [n_in, H, dv], model dtype
    beta: torch.Tensor  # [n_in, H] fp32 (an fp32 sigmoid: the model dtype would round it)
    mixed: torch.Tensor  # [n_mix, 3C], model dtype, slot p % n_mix: position p's pre-conv row

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.conv, self.rec, self.k, self.g, self.v, self.beta, self.mixed))


@dataclass
class MlaLayerState:
    latent: torch.Tensor  # [capacity, kv_lora], model dtype or FP8; a PagedRows view in a paged state
    dsa: Glm5NextDsaState | None  # full layers only

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + (self.dsa.nbytes if self.dsa is not None else 0)


class Glm5State(SequenceState):
    """One sequence. Create with `model.new_state(capacity, max_rewind)`; never construct directly.
    The KDA layers hold their state at `kda_base` and the inputs of positions [kda_base,
    written_until) (module docstring); `kda_cuts` lists the chunk starts in that range (the base
    first), `kda_mix_low` the first position whose pre-conv row is still in the `mixed` ring."""

    def __init__(self, layers: list, *, kv_fp8: bool = False, tp=None, **kw):
        super().__init__(layers, **kw)
        self.kv_fp8 = kv_fp8  # MLA latent rows and indexer keys stored as float8_e4m3fn
        self.tp = tp  # under tensor parallelism the KDA state holds this rank's heads (sharding.py)
        kda = [ls for ls in layers if isinstance(ls, KdaLayerState)]
        self.n_in = kda[0].k.shape[0] if kda else 0
        self.n_mix = kda[0].mixed.shape[0] if kda else 0
        self.km1 = kda[0].conv.shape[0] if kda else 0
        self.kda_base, self.kda_cuts, self.kda_mix_low = 0, [], 0
        self._kda_plan = None

    # ---- the KDA state at a position: replayed from the base ------------------------------------
    def _kda_servable(self, n: int) -> bool:
        """Whether the KDA state at n can be rebuilt: n in [kda_base, written_until] (the ring holds
        every input of [kda_base, written_until)) and its conv rows at or above the base in `mixed`."""
        if n < self.kda_base or n > self.written_until:
            return False
        lo = max(n - self.km1, self.kda_base)
        return lo >= n or lo >= self.kda_mix_low

    def _kda_conv(self, ls: KdaLayerState, n: int, full: torch.Tensor | None = None, start: int = 0):
        """The conv state at n: rows of positions [n-K+1, n), from the running call's `full` (at or
        above `start`), the `mixed` ring (at or above the base) or the base's conv state."""
        rows = []
        for p in range(n - self.km1, n):
            if full is not None and p >= start:
                rows.append(full[p - start + self.km1])
            elif p < self.kda_base:
                rows.append(ls.conv[p - self.kda_base + self.km1])
            else:
                if p < self.kda_mix_low:  # _kda_servable guards every caller
                    raise RuntimeError(f"KDA conv row {p} is no longer held (from {self.kda_mix_low})")
                rows.append(ls.mixed[p % self.n_mix])
        return torch.stack(rows) if rows else ls.conv[:0]

    def _kda_at(self, ls: KdaLayerState, n: int, capture: int | None = None):
        """(conv, rec, captured) of one KDA layer at position n: `kda_chunked` over the stored inputs
        of each forward chunk in [kda_base, n) (n is a chunk start or written_until), from the base.
        `captured` is (conv, rec) at the boundary `capture` on the way (None if not asked)."""
        rec, cap = ls.rec, None
        if capture == self.kda_base:
            cap = (ls.conv, ls.rec)
        ends = self.kda_cuts[1:] + [self.written_until]
        for b0, b1 in zip(self.kda_cuts, ends):
            if b0 >= n:
                break
            b1 = min(b1, n)
            idx = torch.arange(b0, b1, device=ls.k.device) % self.n_in
            # one forward chunk (or its head up to n); kda_chunked copies its inputs afresh (kda.py)
            _, rec, _ = kda_chunked(None, ls.k[idx], ls.v[idx].float(), ls.g[idx], ls.beta[idx], rec,
                                    starts=[0])
            if capture == b1:
                cap = (self._kda_conv(ls, b1), rec)
        conv = ls.conv if n == self.kda_base else self._kda_conv(ls, n)
        return conv, rec, cap

    def _kda_begin(self, start: int, t: int) -> None:
        """Plan a forward of t tokens at `start` (before any layer runs): its chunk starts, the new
        base and the chunk starts kept. The base is the latest boundary <= written_until - max_rewind
        whose inputs fit the ring (and whose conv rows are held), else the earliest one that fits."""
        wu = start + t
        starts = kda_chunk_starts(t, t - self.max_rewind)  # call-relative; singles from wu - max_rewind
        bounds = [b for b in self.kda_cuts if b < start] + [start + a for a in starts]
        fits = [b for b in bounds + [wu] if wu - b <= self.n_in and (b >= start or self._kda_servable(b))]
        below = [b for b in fits if b <= wu - self.max_rewind]
        nb = max(below) if below else min(fits)
        low = max(wu - self.n_mix, min(self.kda_mix_low, start))
        self._kda_plan = (start, t, nb, [b for b in bounds if b >= nb], low, starts)

    def _kda_forward(self, attn, ls: KdaLayerState, x: torch.Tensor, start: int, ops: Backend) -> torch.Tensor:
        """One KDA layer's forward of x at `start`, as planned by `_kda_begin`: its state at start
        replayed from the base, then its inputs stored and the new base kept. `ops`: the model's
        Backend (numerics/backend.py), passed to the layer."""
        _, t, nb, _, _, starts = self._kda_plan
        wu = start + t
        conv0, rec0, cap = self._kda_at(ls, start, capture=nb if nb <= start else None)
        inside = start < nb < wu
        y, step = attn(x, conv0, rec0, ops, starts=starts, keep_at=[nb - start] if inside else [])
        if nb <= start:
            base = cap
        elif nb == wu:
            base = (step.full[t:], step.rec)
        else:
            base = (step.full[nb - start: nb - start + self.km1], step.kept[0])
        first = max(start, wu - self.n_in)
        if first < wu:
            idx, i = torch.arange(first, wu, device=ls.k.device) % self.n_in, first - start
            ls.k[idx], ls.g[idx] = step.k[i:], step.g[i:]
            ls.v[idx], ls.beta[idx] = step.v[i:].to(ls.v.dtype), step.beta[i:]
        first = max(start, wu - self.n_mix)
        if first < wu:
            idx = torch.arange(first, wu, device=ls.k.device) % self.n_mix
            ls.mixed[idx] = step.full[first - start + self.km1:]
        ls.conv.copy_(base[0])
        ls.rec.copy_(base[1])
        return y

    def _kda_commit(self) -> None:
        """After every layer ran the planned forward: move the base and the cursors."""
        start, t, nb, cuts, low, _ = self._kda_plan
        self.kda_base, self.kda_cuts, self.kda_mix_low = nb, cuts, low
        self._kda_plan = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def free(self) -> None:
        """Release every buffer and page reference. A second call does nothing; later use raises
        FreedStateError."""
        if self.layers is None:
            return
        for ls in self.layers:
            if isinstance(ls, MlaLayerState) and ls.dsa is not None:
                ls.dsa.free()
        super().free()

    # ---- cursors ------------------------------------------------------------------------------
    # One cursor model: `pos` is the sequence's, and every full DSA layer's Glm5NextDsaState keeps
    # `len == pos`, moved only through that contract's own methods (seed: rewind_to only shrinks;
    # sync_to rewinds if ahead, refuses if behind, then advances, after its room check). This
    # state's checks (the KDA inputs held, max_rewind, the rewind floor) run first, so a refusal
    # changes neither pos nor any len.
    def _dsa_states(self) -> list[Glm5NextDsaState]:
        return [ls.dsa for ls in self.layers if isinstance(ls, MlaLayerState) and ls.dsa is not None]

    def _dsa_sync(self, seq_len: int, k: int) -> None:
        """Every indexer state's `sync_to(seq_len, k)`, once all have room for seq_len + k."""
        dsas = self._dsa_states()
        for dsa in dsas:
            dsa.ensure_room_through(seq_len + k)
        for dsa in dsas:
            dsa.sync_to(seq_len, k)

    def graph_inputs(self, k: int) -> tuple[int, ...]:
        """The KDA plan of a graph step's k tokens at pos, as a forward's (`_kda_begin`): (start,
        the base the step replays from, the new base whose state it keeps, the end)."""
        self._kda_begin(self.pos, k)
        return self.pos, self.kda_base, self._kda_plan[2], self.pos + k

    def after_graph_step(self, k: int) -> None:
        """SequenceState.after_graph_step; the indexer states' counters go where decode would have
        left them (the seed's `sync_to`), and the KDA cursors as the planned forward leaves them."""
        self._dsa_sync(self.pos, k)
        super().after_graph_step(k)
        self._kda_commit()

    def start_at(self, n: int) -> None:
        """SequenceState.start_at; the indexer states advance over n rows that stay zero (valid 0:
        padding, which no selection reads) and the KDA base is n."""
        self._check_start_at(n)  # before the indexer states move
        self._dsa_sync(0, n)
        super().start_at(n)
        self.kda_base, self.kda_cuts, self.kda_mix_low = n, [], n

    def rewind_to(self, n: int) -> None:
        """Undo the tokens after position n (a rejected draft): only shrinks, by at most max_rewind."""
        self._check_alive()
        if n > self.pos:
            raise RewindError(f"rewind_to({n}) would grow the sequence (pos is {self.pos}); rewind only shrinks")
        # the KDA inputs are held for positions [written_until - max_rewind, written_until] (at least)
        if n < 0 or n < self.written_until - self.max_rewind:
            raise RewindError(
                f"rewind_to({n}) undoes {self.written_until - n} written tokens but this state keeps only "
                f"max_rewind={self.max_rewind} tokens of KDA inputs; create it with model.new_state(..., max_rewind="
                f"{max(self.written_until - n, 0)}) or restore an earlier snapshot")
        if n < self.rewind_floor:
            raise RewindError(f"rewind_to({n}) goes below position {self.rewind_floor}, where this state was "
                              f"restored from a snapshot; restore an earlier snapshot instead")
        if not self._kda_servable(n):
            raise RewindError(f"rewind_to({n}): the KDA inputs of positions below {self.kda_base} are no longer "
                              f"held (an earlier rewind was followed by a forward); restore a snapshot instead")
        self._dsa_sync(n, 0)
        self.pos = n

    def advance(self, k: int) -> None:
        """Re-expose k positions already written past pos (by a verify pass that was rewound)."""
        self._check_alive()
        if k < 0 or self.pos + k > self.written_until or not self._kda_servable(self.pos + k):
            raise RewindError(f"advance({k}) from pos {self.pos} passes the rows written so far "
                              f"(up to {self.written_until}) or their kept KDA states; run forward() instead")
        self._dsa_sync(self.pos, k)
        self.pos += k

    def sync_to(self, seq_len: int, k: int) -> None:
        """Rewind to seq_len if ahead, refuse if behind, then advance by k. Refusals change nothing."""
        self._check_alive()
        if self.pos < seq_len:
            raise RewindError(f"sync_to({seq_len}, {k}): state is behind (pos {self.pos}); "
                              f"feed the missing tokens with forward() first")
        end = seq_len + k
        if k < 0 or end > self.written_until or end < self.written_until - self.max_rewind \
                or seq_len < self.rewind_floor or not self._kda_servable(end):
            raise RewindError(f"sync_to({seq_len}, {k}) needs the state at {end} but only positions "
                              f"[{max(self.written_until - self.max_rewind, self.rewind_floor)}, "
                              f"{self.written_until}] are held")
        self._dsa_sync(seq_len, k)
        self.pos = end

    def _encode(self, pools: bool = True) -> bytes:
        return encode(self, pools)

    def _decode_and_apply(self, blob: bytes) -> None:
        decode_and_apply(self, blob)


# ---- snapshot format ------------------------------------------------------------------------------
# The shared framing of kvfold/state/blob.py; a full DSA layer's indexer rows travel as ONE section
# holding exactly that layer's `Glm5NextDsaState.snapshot_blob()` bytes (u8, width 1), which
# restore goes back through `check_blob` / `restore_blob`. docs/state-format.md has the layout.
KDA_CONV, KDA_REC, MLA_LATENT, DSA_BLOB = range(4)
KIND_NAMES = ["KDA conv", "KDA recurrent", "MLA latent", "DSA indexer blob"]
# FP8 KV state: latent rows and indexer keys are float8_e4m3fn (the blob holds their raw bytes).
# A flag, not a new version: blobs of plain states are unchanged.
FLAG_FP8_KV = blob.FLAG_FP8_KV
# a paged state's prefix-cache and fork snapshots: latent sections start after the whole pages before
# pos (those rows live in pages shared by reference); everything else is in the blob as always
FLAG_NO_POOLS = blob.FLAG_NO_POOLS
# version 2: each DSA layer's indexer cache is one section holding its Glm5NextDsaState blob
FORMAT = blob.Format(magic=b"KVFGLM5S", what="kvfold GLM-5 state", kind_names=KIND_NAMES, version=2,
                     known_flags=FLAG_FP8_KV | FLAG_NO_POOLS, layout_flags=FLAG_NO_POOLS)
MAGIC = FORMAT.magic


def _flags(state: Glm5State) -> int:
    return FLAG_FP8_KV if state.kv_fp8 else 0


def expected_sections(state: Glm5State, pos: int, layout: int = 0) -> list[Section]:
    skip = shared_tokens(state, pos) if layout & FLAG_NO_POOLS else 0
    sd, f32, u8 = DTYPE_CODES[state.dtype], DTYPE_CODES[torch.float32], DTYPE_CODES[torch.uint8]
    secs = []
    for i, ls in enumerate(state.layers):
        if isinstance(ls, KdaLayerState):  # the whole layer's, every rank's heads (layout-free)
            parts = state.tp.size if state.tp is not None else 1
            km1, w = ls.conv.shape
            h, dk, dv = ls.rec.shape
            w, h = w * parts, h * parts
            secs.append(Section(i, KDA_CONV, 0, km1, w, sd))
            secs.append(Section(i, KDA_REC, 0, h * dk, dv, f32))
        else:
            secs.append(Section(i, MLA_LATENT, skip, pos - skip, ls.latent.shape[1], DTYPE_CODES[ls.latent.dtype]))
            if ls.dsa is not None:  # rows = bytes of the layer's blob at len pos
                dsa = ls.dsa
                secs.append(Section(i, DSA_BLOB, 0, dsa_blob_bytes(pos, dsa.index_head_dim, dsa.dtype, dsa.key_dtype),
                                    1, u8))
    return secs


def _rows_of(state: Glm5State, s: Section, at: dict) -> torch.Tensor:
    ls = state.layers[s.layer]
    if s.kind in (KDA_CONV, KDA_REC):  # the KDA state at pos, replayed once per layer
        if s.layer not in at:
            at[s.layer] = _whole_kda(state, *state._kda_at(ls, state.pos)[:2])
        conv, rec = at[s.layer]
        return conv if s.kind == KDA_CONV else rec.reshape(-1, rec.shape[-1])
    if s.kind == MLA_LATENT:
        return ls.latent[s.first:s.first + s.rows]
    return torch.frombuffer(bytearray(ls.dsa.snapshot_blob()), dtype=torch.uint8).view(-1, 1)


def _whole_kda(state: Glm5State, conv: torch.Tensor, rec: torch.Tensor):
    """Under tensor parallelism, every rank's KDA heads in the whole layer's layout: conv rows are
    q | k | v, each its heads' channels in head order; rec [H, dk, dv] in head order. (Every rank
    snapshots at the same step, so the gather is one collective.)"""
    tp = state.tp
    if tp is None or tp.size == 1:
        return conv, rec
    convs, recs = tp.gather(conv), tp.gather(rec)
    c = conv.shape[1] // 3
    whole = torch.cat([part[:, j * c:(j + 1) * c] for j in range(3) for part in convs], dim=1)
    return whole, torch.cat(recs, dim=0)


def _own_kda(state: Glm5State, conv: torch.Tensor, rec: torch.Tensor):
    """This rank's heads of a whole layer's KDA state (the inverse of `_whole_kda`)."""
    tp = state.tp
    if tp is None or tp.size == 1:
        return conv, rec
    c, h = conv.shape[1] // 3 // tp.size, rec.shape[0] // tp.size
    r = tp.rank
    own = torch.cat([conv[:, j * c * tp.size + r * c: j * c * tp.size + (r + 1) * c] for j in range(3)], dim=1)
    return own, rec[r * h:(r + 1) * h]


def encode(state: Glm5State, pools: bool = True) -> bytes:
    at: dict = {}
    layout = 0 if pools else FLAG_NO_POOLS
    return blob.encode(FORMAT, state, _flags(state) | layout, expected_sections(state, state.pos, layout),
                       lambda s: _rows_of(state, s, at))


def decode_and_apply(state: Glm5State, data: bytes) -> None:
    pos, sections = blob.decode(FORMAT, state, data, flags_of_state=_flags(state),
                                expected_sections=lambda p, layout: expected_sections(state, p, layout))
    check_restore_pages(state, pos, bool(blob.HEADER.unpack_from(data, 0)[2] & FLAG_NO_POOLS))
    # then every DSA layer's blob through the indexer state's own checks, all before any write.
    # The table fixed each blob's byte count from pos and this state's width and dtype, so a blob
    # that passes has len pos; one whose header was altered (and re-signed) is refused here.
    dsa_blobs = []
    for s, r in sections:
        if s.kind == DSA_BLOB:
            raw = r.cpu().numpy().tobytes()
            state.layers[s.layer].dsa.check_blob(raw)
            dsa_blobs.append((s.layer, raw))
    # all checks passed: write
    whole: dict = {}
    for s, r in sections:
        if s.kind in (KDA_CONV, KDA_REC):
            whole.setdefault(s.layer, {})[s.kind] = r
    for s, r in sections:
        ls = state.layers[s.layer]
        if s.kind == KDA_CONV:
            h, dk, dv = ls.rec.shape
            parts = state.tp.size if state.tp is not None else 1
            conv, rec = _own_kda(state, r, whole[s.layer][KDA_REC].reshape(h * parts, dk, dv))
            ls.conv.copy_(conv)
            ls.rec.copy_(rec)
        elif s.kind == MLA_LATENT:
            ls.latent[s.first:s.first + s.rows] = r
    for i, raw in dsa_blobs:
        state.layers[i].dsa.restore_blob(raw)
    state.pos = state.written_until = state.rewind_floor = pos
    state.kda_base, state.kda_cuts, state.kda_mix_low = pos, [], pos  # the base is the restored state
