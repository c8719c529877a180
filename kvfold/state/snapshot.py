"""Versioned binary snapshots of a Dsv4State: only the rows still in use at `pos`.

Layout (all little-endian; see docs/state-format.md):
  header  64 B   magic, version, flags, fingerprint, dtype, n_sections, pos, body_len, reserved
  table   32 B per section: layer, kind, first, rows, width, dtype
  body    the rows of each section in table order, row-major
  trailer 32 B   SHA-256 over header + table + body
Every check runs, in a fixed order, before the target is touched.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from .kv_rows import KvRows
from ..errors import (SnapshotCapacityError, SnapshotChecksumError, SnapshotCountsError, SnapshotDtypeError,
                      SnapshotMagicError, SnapshotModelError, SnapshotSizeError, SnapshotTruncatedError,
                      SnapshotVersionError)

MAGIC = b"KVFOLDST"
VERSION = 1
FLAG_FP8_KV = 1  # window rows and compressed entries are stored in FP8 (the blob holds them decoded)
KNOWN_FLAGS = FLAG_FP8_KV
_HEADER = struct.Struct("<8sII16sIIQQQ")  # 64 bytes
_SECTION = struct.Struct("<IIQQII")  # 32 bytes
_DIGEST = 32

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

# section kinds
WINDOW, COMP_KV, COMP_SCORE, COMP_POOL, IX_KV, IX_SCORE, IX_POOL = range(7)
KIND_NAMES = ["window", "compressor kv", "compressor score", "compressed pool",
              "indexer kv", "indexer score", "indexer pool"]


@dataclass(frozen=True)
class Section:
    layer: int
    kind: int
    first: int  # first position (rings) or first entry (pools)
    rows: int
    width: int
    dtype: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * CODE_DTYPES[self.dtype].itemsize


def _flags(state) -> int:
    return FLAG_FP8_KV if getattr(state, "kv_fp8", False) else 0


def _buffers(ls, kind):
    """(kind -> tensor-or-ring) of one layer, for the kinds this layer has."""
    out = {WINDOW: ls.window}
    if ls.compressor is not None:
        out.update({COMP_KV: ls.compressor.kv, COMP_SCORE: ls.compressor.score, COMP_POOL: ls.compressor.pool})
    if ls.indexer is not None:
        out.update({IX_KV: ls.indexer.kv, IX_SCORE: ls.indexer.score, IX_POOL: ls.indexer.pool})
    return out.get(kind)


def expected_sections(state, pos: int) -> list[Section]:
    """The sections a snapshot at `pos` holds for a state of this geometry."""
    sd = DTYPE_CODES[state.dtype]
    f32 = DTYPE_CODES[torch.float32]
    secs = []
    for i, ls in enumerate(state.layers):
        first = max(0, pos - state.window + 1)
        secs.append(Section(i, WINDOW, first, pos - first, ls.window.store.width, sd))
        for comp, kinds in ((ls.compressor, (COMP_KV, COMP_SCORE, COMP_POOL)), (ls.indexer, (IX_KV, IX_SCORE, IX_POOL))):
            if comp is None:
                continue
            r = comp.ratio
            # the open window's rows, and (overlapping) the previous window's for its Ca half
            first = max(0, (pos // r) * r - (r if comp.overlap else 0))
            secs.append(Section(i, kinds[0], first, pos - first, comp.kv.store.width, f32))
            secs.append(Section(i, kinds[1], first, pos - first, comp.score.store.width, f32))
            secs.append(Section(i, kinds[2], 0, pos // r, comp.pool.width, sd))
    return secs


def _rows_of(state, s: Section) -> torch.Tensor:
    buf = _buffers(state.layers[s.layer], s.kind)
    if isinstance(buf, KvRows):
        return buf[s.first:s.first + s.rows]
    return buf.read(s.first, s.first + s.rows)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode(state) -> bytes:
    secs = expected_sections(state, state.pos)
    body = b"".join(_to_bytes(_rows_of(state, s)) for s in secs)
    header = _HEADER.pack(MAGIC, VERSION, _flags(state), state.fingerprint.encode().ljust(16, b"\0")[:16],
                          DTYPE_CODES[state.dtype], len(secs), state.pos, len(body), 0)
    table = b"".join(_SECTION.pack(s.layer, s.kind, s.first, s.rows, s.width, s.dtype) for s in secs)
    payload = header + table + body
    return payload + hashlib.sha256(payload).digest()


def _name(s: Section) -> str:
    return f"layer {s.layer} {KIND_NAMES[s.kind] if s.kind < len(KIND_NAMES) else f'kind {s.kind}'}"


def decode_and_apply(state, blob: bytes) -> None:
    blob = bytes(blob)
    # 1. truncated
    if len(blob) < _HEADER.size:
        raise SnapshotTruncatedError(f"snapshot is {len(blob)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, flags, fp, dtype_code, n_sec, pos, body_len, reserved = _HEADER.unpack_from(blob, 0)
    table_end = _HEADER.size + n_sec * _SECTION.size
    if magic == MAGIC and len(blob) < table_end:
        raise SnapshotTruncatedError(f"snapshot is {len(blob)} bytes but its section table ends at {table_end}")
    # 2. magic, 3. version
    if magic != MAGIC:
        raise SnapshotMagicError(f"not a kvfold state snapshot (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise SnapshotVersionError(f"snapshot format version {version} is not supported (this kvfold reads "
                                   f"version {VERSION}); re-save it with a matching kvfold")
    if flags & ~KNOWN_FLAGS or reserved:
        # a later format may give these meaning; reading them as version 1 would misread the blob
        raise SnapshotVersionError(f"snapshot uses header flags {flags:#x} / reserved {reserved:#x} that "
                                   f"format version {VERSION} does not define; re-save it with a matching kvfold")
    # 4. model, 5. dtype
    fp_str = fp.rstrip(b"\0").decode(errors="replace")
    if fp_str != state.fingerprint:
        raise SnapshotModelError(f"snapshot was taken from a model with config fingerprint {fp_str}; this state "
                                 f"belongs to {state.fingerprint}; restore it into a state of the same model")
    if (flags & FLAG_FP8_KV) != _flags(state):
        blob_kv, own_kv = ("fp8" if flags & FLAG_FP8_KV else "plain"), ("fp8" if _flags(state) else "plain")
        hint = "kv_dtype='fp8'" if blob_kv == "fp8" else "the default kv_dtype"
        raise SnapshotDtypeError(f"snapshot KV storage is {blob_kv} but this state's is {own_kv}; restore it "
                                 f"into a state made with new_state(..., {hint})")
    if CODE_DTYPES.get(dtype_code) != state.dtype:
        raise SnapshotDtypeError(f"snapshot dtype {CODE_DTYPES.get(dtype_code, dtype_code)} differs from the "
                                 f"state's {state.dtype}; load the model with the snapshot's dtype")
    # 6. counts follow from pos
    got = [Section(*_SECTION.unpack_from(blob, _HEADER.size + i * _SECTION.size)) for i in range(n_sec)]
    want = expected_sections(state, pos)
    if got != want:
        if len(got) != len(want):
            detail = f"{len(got)} sections, expected {len(want)}"
        else:
            g, w = next((g, w) for g, w in zip(got, want) if g != w)
            detail = f"{_name(w)}: first={g.first} rows={g.rows} width={g.width}, expected first={w.first} " \
                     f"rows={w.rows} width={w.width}"
        raise SnapshotCountsError(f"snapshot section table is inconsistent with pos={pos} ({detail})")
    # 7. body size
    need = sum(s.nbytes for s in want)
    total = table_end + body_len + _DIGEST
    if body_len != need or len(blob) != total:
        raise SnapshotSizeError(f"snapshot body size mismatch: table needs {need} body bytes, header says "
                                f"{body_len}, blob has {len(blob) - table_end - _DIGEST} (missing or trailing bytes)")
    # 8. checksum
    if hashlib.sha256(blob[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise SnapshotChecksumError("snapshot checksum mismatch: the blob is corrupted")
    # 9. capacity
    if pos > state.capacity:
        raise SnapshotCapacityError(f"snapshot is at pos {pos}, beyond this state's capacity {state.capacity}; "
                                    f"restore into model.new_state(capacity>={pos})")
    # all checks passed: decode every section, then write
    rows, off = [], table_end
    for s in want:
        raw = torch.frombuffer(bytearray(blob[off:off + s.nbytes]), dtype=torch.uint8) if s.nbytes else \
            torch.empty(0, dtype=torch.uint8)
        rows.append(raw.view(CODE_DTYPES[s.dtype]).reshape(s.rows, s.width).to(state.device))
        off += s.nbytes
    for s, r in zip(want, rows):
        buf = _buffers(state.layers[s.layer], s.kind)
        if isinstance(buf, KvRows):
            buf[s.first:s.first + s.rows] = r
        else:
            buf.write(s.first, r)
    state.pos = state.written_until = state.rewind_floor = pos
