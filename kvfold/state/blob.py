"""The framing every kvfold state snapshot shares (DeepSeek-V4 and GLM-5.3 states alike).

Layout (all little-endian; see docs/state-format.md):
  header  64 B   magic, version, flags, fingerprint, dtype, n_sections, pos, body_len, reserved
  table   32 B per section: layer, kind, first, rows, width, dtype
  body    the rows of each section in table order, row-major
  trailer 32 B   SHA-256 over header + table + body
A model's codec says which sections a state holds at `pos` (a pure function of config and pos,
so a reader recomputes the table and compares) and how to read and write their rows; `decode`
runs every check, in the documented order, before the caller writes anything.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from ..errors import (SnapshotCapacityError, SnapshotChecksumError, SnapshotCountsError, SnapshotDtypeError,
                      SnapshotMagicError, SnapshotModelError, SnapshotSizeError, SnapshotTruncatedError,
                      SnapshotVersionError)

VERSION = 1
HEADER = struct.Struct("<8sII16sIIQQQ")  # 64 bytes
SECTION = struct.Struct("<IIQQII")  # 32 bytes
DIGEST = 32

FLAG_FP8_KV = 1  # header flag bit 0, in every format: the state stores its KV rows in FP8 (kv_dtype="fp8")
# a layout flag (bits 8-15), in every format with paged pools: the pool sections leave out the rows of
# the whole pages before pos, which live in pages shared by reference (snapshot(pools=False))
FLAG_NO_POOLS = 0x100
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4, torch.uint8: 6}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Section:
    layer: int
    kind: int
    first: int  # first position (rings) or first row (prefix-shaped buffers)
    rows: int
    width: int
    dtype: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * CODE_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Format:
    """One snapshot family: its magic, its format version, the header flags it defines, and its
    section names. Each family versions its own layout: a blob of another version is refused."""
    magic: bytes
    what: str  # "kvfold state", "kvfold GLM-5 state": for messages
    kind_names: Sequence[str]
    known_flags: int = 0
    version: int = VERSION
    # flags that choose which sections a blob holds (not how the state stores rows): they are
    # not compared with the state's, and `expected_sections` receives them as a second argument
    layout_flags: int = 0


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode(fmt: Format, state, flags: int, sections: list[Section], rows_of: Callable[[Section], torch.Tensor]) -> bytes:
    body = b"".join(_to_bytes(rows_of(s)) for s in sections)
    header = HEADER.pack(fmt.magic, fmt.version, flags, state.fingerprint.encode().ljust(16, b"\0")[:16],
                         DTYPE_CODES[state.dtype], len(sections), state.pos, len(body), 0)
    table = b"".join(SECTION.pack(s.layer, s.kind, s.first, s.rows, s.width, s.dtype) for s in sections)
    payload = header + table + body
    return payload + hashlib.sha256(payload).digest()


def decode(fmt: Format, state, blob: bytes, *, flags_of_state: int,
           expected_sections: Callable[[int], list[Section]]) -> tuple[int, list[tuple[Section, torch.Tensor]]]:
    """Check `blob` against `state` and return (pos, [(section, rows on the state's device)]).

    Refusals, in order: truncated; bad magic; unsupported version (or undefined flags / reserved
    bits); other model; other dtype (or other storage flags); counts inconsistent with pos; body
    size mismatch; checksum mismatch; pos beyond the state's capacity. Nothing is written here."""
    blob = bytes(blob)
    h = _read_header(fmt, blob)
    _check_owner(fmt, state, h, flags_of_state)
    want = _check_sections(fmt, blob, h, expected_sections)
    _check_body(blob, h, want)
    if h.pos > state.capacity:
        raise SnapshotCapacityError(f"snapshot is at pos {h.pos}, beyond this state's capacity {state.capacity}; "
                                    f"restore into model.new_state(capacity>={h.pos})")
    return h.pos, _section_rows(blob, want, h.table_end, state.device)


class _Header(NamedTuple):
    magic: bytes
    version: int
    flags: int
    fingerprint: bytes
    dtype_code: int
    n_sections: int
    pos: int
    body_len: int
    reserved: int

    @property
    def table_end(self) -> int:
        return HEADER.size + self.n_sections * SECTION.size


def _read_header(fmt: Format, blob: bytes) -> _Header:
    """The header, once the blob is long enough to hold it and its table, is of this family, and is
    of a version (and uses only flags) this reader defines."""
    if len(blob) < HEADER.size:
        raise SnapshotTruncatedError(f"snapshot is {len(blob)} bytes, shorter than its {HEADER.size}-byte header")
    h = _Header(*HEADER.unpack_from(blob, 0))
    if h.magic == fmt.magic and len(blob) < h.table_end:
        raise SnapshotTruncatedError(f"snapshot is {len(blob)} bytes but its section table ends at {h.table_end}")
    if h.magic != fmt.magic:
        raise SnapshotMagicError(f"not a {fmt.what} snapshot (magic {h.magic!r}, expected {fmt.magic!r})")
    if h.version != fmt.version:
        raise SnapshotVersionError(f"{fmt.what} snapshot format version {h.version} is not supported (this kvfold "
                                   f"reads version {fmt.version}); re-save it with a matching kvfold")
    if h.flags & ~fmt.known_flags or h.reserved:
        # a later format may give these meaning; reading them as version 1 would misread the blob
        raise SnapshotVersionError(f"snapshot uses header flags {h.flags:#x} / reserved {h.reserved:#x} that "
                                   f"format version {fmt.version} does not define; re-save it with a matching kvfold")
    return h


def _check_owner(fmt: Format, state, h: _Header, flags_of_state: int) -> None:
    """Refuse a snapshot of another model, or one whose rows are stored otherwise than `state`'s
    (storage flags, dtype)."""
    fp_str = h.fingerprint.rstrip(b"\0").decode(errors="replace")
    if fp_str != state.fingerprint:
        raise SnapshotModelError(f"snapshot was taken from a model with config fingerprint {fp_str}; this state "
                                 f"belongs to {state.fingerprint}; restore it into a state of the same model")
    if h.flags & ~fmt.layout_flags != flags_of_state:
        raise SnapshotDtypeError(_storage_mismatch(h.flags & ~fmt.layout_flags, flags_of_state))
    if CODE_DTYPES.get(h.dtype_code) != state.dtype:
        raise SnapshotDtypeError(f"snapshot dtype {CODE_DTYPES.get(h.dtype_code, h.dtype_code)} differs from the "
                                 f"state's {state.dtype}; load the model with the snapshot's dtype")


def _storage_mismatch(blob_flags: int, own_flags: int) -> str:
    if not (blob_flags ^ own_flags) & FLAG_FP8_KV:
        return f"snapshot storage flags {blob_flags:#x} differ from this state's {own_flags:#x}"
    blob_kv, own_kv = ("fp8" if f & FLAG_FP8_KV else "plain" for f in (blob_flags, own_flags))
    hint = "kv_dtype='fp8'" if blob_kv == "fp8" else "the default kv_dtype"
    return (f"snapshot KV storage is {blob_kv} but this state's is {own_kv}; restore it into a state made "
            f"with new_state(..., {hint})")


def _check_sections(fmt: Format, blob: bytes, h: _Header, expected_sections: Callable) -> list[Section]:
    """The section table, when it is exactly the one the codec expects at the header's pos (and layout flags)."""
    got = [Section(*SECTION.unpack_from(blob, HEADER.size + i * SECTION.size)) for i in range(h.n_sections)]
    want = expected_sections(h.pos, h.flags & fmt.layout_flags) if fmt.layout_flags else expected_sections(h.pos)
    if got == want:
        return want
    if len(got) != len(want):
        detail = f"{len(got)} sections, expected {len(want)}"
    else:
        g, w = next((g, w) for g, w in zip(got, want) if g != w)
        name = fmt.kind_names[w.kind] if w.kind < len(fmt.kind_names) else f"kind {w.kind}"
        detail = (f"layer {w.layer} {name}: first={g.first} rows={g.rows} width={g.width}, "
                  f"expected first={w.first} rows={w.rows} width={w.width}")
    raise SnapshotCountsError(f"snapshot section table is inconsistent with pos={h.pos} ({detail})")


def _check_body(blob: bytes, h: _Header, sections: list[Section]) -> None:
    """Refuse a body of another size than the table needs, or a blob whose checksum does not match."""
    need = sum(s.nbytes for s in sections)
    if h.body_len != need or len(blob) != h.table_end + h.body_len + DIGEST:
        has = len(blob) - h.table_end - DIGEST
        raise SnapshotSizeError(f"snapshot body size mismatch: table needs {need} body bytes, header says "
                                f"{h.body_len}, blob has {has} (missing or trailing bytes)")
    if hashlib.sha256(blob[:-DIGEST]).digest() != blob[-DIGEST:]:
        raise SnapshotChecksumError("snapshot checksum mismatch: the blob is corrupted")


def _section_rows(blob: bytes, sections: list[Section], offset: int,
                  device) -> list[tuple[Section, torch.Tensor]]:
    """Each section's rows, read from the body starting at `offset`, as (rows, width) tensors on `device`."""
    out = []
    for s in sections:
        raw = torch.frombuffer(bytearray(blob[offset:offset + s.nbytes]), dtype=torch.uint8) if s.nbytes else \
            torch.empty(0, dtype=torch.uint8)
        out.append((s, raw.view(CODE_DTYPES[s.dtype]).reshape(s.rows, s.width).to(device)))
        offset += s.nbytes
    return out
