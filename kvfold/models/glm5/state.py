"""Per-sequence state of a GLM-5.3 (`glm5_next`) model: preallocated, addressed by position.

Per layer:
* KDA layer: the conv state (pre-conv inputs of the last K-1 tokens, [K-1, 3C], model dtype) and
  the recurrent state S ([H, dk, dv], fp32). These are overwritten by every token and cannot be
  rewound by truncation, so they live in a **ring of max_rewind + 1 slots
  addressed by position**: slot p % (max_rewind + 1) holds the state after p tokens. A forward at
  pos P over T tokens writes the slots of positions max(P+1, P+T-max_rewind) .. P+T (the trailing
  tokens run token by token so each per-step state exists); `rewind_to(n)` then only moves `pos`,
  for any n >= pos - max_rewind. Memory: (max_rewind + 1) x (H*dk*dv*4 + (K-1)*3*H*dk*itemsize)
  bytes per KDA layer, e.g. GLM-5.3-Flash (34 KDA layers, 64 x 128 x 128, K 4, bf16):
  4,341,760 B per layer and slot, 147.6 MB (140.8 MiB) per slot for the model, so max_rewind 4
  costs 5 x 140.8 MiB = 704 MiB per sequence. The alternative (replaying the accepted tokens from
  a snapshot at the verify start) would cost no memory but a second forward per rejection.
* DSA layer: the MLA latent rows [capacity, kv_lora] (model dtype), prefix-shaped, row p = token p.
* Full DSA layer: additionally one `Glm5NextDsaState` (indexer keys, gates, validity), whose
  `len` tracks `pos`. It is allocated with capacity rounded *up* to whole k-pools so it never
  refuses a position below the state's capacity.

MLA latent and DSA rows rewind by cursor: rows past `pos` are unreachable and overwritten later.

Snapshots (`snapshot()` / `restore()`, docs/state-format.md): the shared framing of
kvfold/state/blob.py with magic b"KVFGLM5S", version 1; 64-byte header (magic, version, flags,
fingerprint, dtype, n_sections, pos, body_len, reserved), a 32-byte entry per section (layer, kind,
first, rows, width, dtype), the body (each section's rows, row-major) and a SHA-256 trailer.
Sections at pos: per KDA layer its conv and recurrent state at pos; per DSA layer the latent rows
[0, pos); per full DSA layer one u8 section holding that layer's `Glm5NextDsaState.snapshot_blob()`
at len pos, byte for byte. Refusals, in this order, before any write: truncated, magic, version
(and unknown flags), model fingerprint, dtype, section table vs pos, body size, checksum, capacity;
then each DSA layer's blob through `check_blob` (truncated, width, size, capacity). A refused
restore changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import RewindError
from ...state import blob
from ...state.blob import DTYPE_CODES, Section
from ...state.base import SequenceState
from .indexer_state import Glm5NextDsaState, dsa_blob_bytes


@dataclass
class KdaLayerState:
    conv: torch.Tensor  # [max_rewind + 1, K-1, 3C], model dtype
    rec: torch.Tensor  # [max_rewind + 1, H, dk, dv], fp32

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.rec.nbytes


@dataclass
class MlaLayerState:
    latent: torch.Tensor  # [capacity, kv_lora], model dtype
    dsa: Glm5NextDsaState | None  # full layers only

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + (self.dsa.nbytes if self.dsa is not None else 0)


class Glm5State(SequenceState):
    """One sequence. Create with `model.new_state(capacity, max_rewind)`; never construct directly.
    `written_until` here also bounds rewinds: the KDA ring holds the states of positions
    [written_until - max_rewind, written_until]."""

    @property
    def slots(self) -> int:
        return self.max_rewind + 1

    def slot(self, p: int) -> int:
        return p % self.slots

    # ---- lifecycle ----------------------------------------------------------------------------
    def free(self) -> None:
        """Release every buffer. A second call does nothing; later use raises FreedStateError."""
        if self.layers is None:
            return
        for ls in self.layers:
            if isinstance(ls, MlaLayerState) and ls.dsa is not None:
                ls.dsa.free()
        self.layers = None

    # ---- cursors ------------------------------------------------------------------------------
    def _sync_dsa(self) -> None:
        for ls in self.layers:
            if isinstance(ls, MlaLayerState) and ls.dsa is not None and ls.dsa.len != self.pos:
                if ls.dsa.len > self.pos:
                    ls.dsa.rewind_to(self.pos)
                else:
                    ls.dsa.advance(self.pos - ls.dsa.len)

    def rewind_to(self, n: int) -> None:
        """Undo the tokens after position n (a rejected draft): only shrinks, by at most max_rewind."""
        self._check_alive()
        if n > self.pos:
            raise RewindError(f"rewind_to({n}) would grow the sequence (pos is {self.pos}); rewind only shrinks")
        # the KDA ring holds the states of positions [written_until - max_rewind, written_until]
        if n < 0 or n < self.written_until - self.max_rewind:
            raise RewindError(
                f"rewind_to({n}) undoes {self.written_until - n} written tokens but this state keeps only "
                f"max_rewind={self.max_rewind} KDA states; create it with model.new_state(..., max_rewind="
                f"{max(self.written_until - n, 0)}) or restore an earlier snapshot")
        if n < self.rewind_floor:
            raise RewindError(f"rewind_to({n}) goes below position {self.rewind_floor}, where this state was "
                              f"restored from a snapshot; restore an earlier snapshot instead")
        self.pos = n
        self._sync_dsa()

    def advance(self, k: int) -> None:
        """Re-expose k positions already written past pos (by a verify pass that was rewound)."""
        self._check_alive()
        if k < 0 or self.pos + k > self.written_until:
            raise RewindError(f"advance({k}) from pos {self.pos} passes the rows written so far "
                              f"(up to {self.written_until}) or their kept KDA states; run forward() instead")
        self.pos += k
        self._sync_dsa()

    def sync_to(self, seq_len: int, k: int) -> None:
        """Rewind to seq_len if ahead, refuse if behind, then advance by k. Refusals change nothing."""
        self._check_alive()
        if self.pos < seq_len:
            raise RewindError(f"sync_to({seq_len}, {k}): state is behind (pos {self.pos}); "
                              f"feed the missing tokens with forward() first")
        end = seq_len + k
        if k < 0 or end > self.written_until or end < self.written_until - self.max_rewind \
                or seq_len < self.rewind_floor:
            raise RewindError(f"sync_to({seq_len}, {k}) needs the state at {end} but only positions "
                              f"[{max(self.written_until - self.max_rewind, self.rewind_floor)}, "
                              f"{self.written_until}] are held")
        self.pos = end
        self._sync_dsa()

    def _encode(self) -> bytes:
        return encode(self)

    def _decode_and_apply(self, blob: bytes) -> None:
        decode_and_apply(self, blob)


# ---- snapshot format ------------------------------------------------------------------------------
# The shared framing of kvfold/state/blob.py; a full DSA layer's indexer rows travel as ONE section
# holding exactly that layer's `Glm5NextDsaState.snapshot_blob()` bytes (u8, width 1), which
# restore goes back through `check_blob` / `restore_blob`. docs/state-format.md has the layout.
KDA_CONV, KDA_REC, MLA_LATENT, DSA_BLOB = range(4)
KIND_NAMES = ["KDA conv", "KDA recurrent", "MLA latent", "DSA indexer blob"]
# version 2: each DSA layer's indexer cache is one section holding its Glm5NextDsaState blob
FORMAT = blob.Format(magic=b"KVFGLM5S", what="kvfold GLM-5 state", kind_names=KIND_NAMES, version=2)
MAGIC = FORMAT.magic


def expected_sections(state: Glm5State, pos: int) -> list[Section]:
    sd, f32, u8 = DTYPE_CODES[state.dtype], DTYPE_CODES[torch.float32], DTYPE_CODES[torch.uint8]
    secs = []
    for i, ls in enumerate(state.layers):
        if isinstance(ls, KdaLayerState):
            _, km1, w = ls.conv.shape
            _, h, dk, dv = ls.rec.shape
            secs.append(Section(i, KDA_CONV, 0, km1, w, sd))
            secs.append(Section(i, KDA_REC, 0, h * dk, dv, f32))
        else:
            secs.append(Section(i, MLA_LATENT, 0, pos, ls.latent.shape[1], sd))
            if ls.dsa is not None:  # rows = bytes of the layer's blob at len pos
                secs.append(Section(i, DSA_BLOB, 0, dsa_blob_bytes(pos, ls.dsa.index_head_dim, ls.dsa.dtype),
                                    1, u8))
    return secs


def _rows_of(state: Glm5State, s: Section) -> torch.Tensor:
    ls = state.layers[s.layer]
    if s.kind == KDA_CONV:
        return ls.conv[state.slot(state.pos)]
    if s.kind == KDA_REC:
        r = ls.rec[state.slot(state.pos)]
        return r.reshape(-1, r.shape[-1])
    if s.kind == MLA_LATENT:
        return ls.latent[:s.rows]
    return torch.frombuffer(bytearray(ls.dsa.snapshot_blob()), dtype=torch.uint8).view(-1, 1)


def encode(state: Glm5State) -> bytes:
    return blob.encode(FORMAT, state, 0, expected_sections(state, state.pos), lambda s: _rows_of(state, s))


def decode_and_apply(state: Glm5State, data: bytes) -> None:
    pos, sections = blob.decode(FORMAT, state, data, flags_of_state=0,
                                expected_sections=lambda p: expected_sections(state, p))
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
    slot = state.slot(pos)
    for s, r in sections:
        ls = state.layers[s.layer]
        if s.kind == KDA_CONV:
            ls.conv[slot] = r
        elif s.kind == KDA_REC:
            ls.rec[slot] = r.view(ls.rec.shape[1:])
        elif s.kind == MLA_LATENT:
            ls.latent[:pos] = r
    for i, raw in dsa_blobs:
        state.layers[i].dsa.restore_blob(raw)
    state.pos = state.written_until = state.rewind_floor = pos
