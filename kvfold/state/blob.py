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
from typing import Callable, Sequence

import torch

from ..errors import (SnapshotCapacityError, SnapshotChecksumError, SnapshotCountsError, SnapshotDtypeError,
                      SnapshotMagicError, SnapshotModelError, SnapshotSizeError, SnapshotTruncatedError,
                      SnapshotVersionError)

VERSION = 1
HEADER = struct.Struct("<8sII16sIIQQQ")  # 64 bytes
SECTION = struct.Struct("<IIQQII")  # 32 bytes
DIGEST = 32

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
    """One snapshot family: its magic, the header flags it defines, and its section names."""
    magic: bytes
    what: str  # "kvfold state", "kvfold GLM-5 state": for messages
    kind_names: Sequence[str]
    known_flags: int = 0
    # flags that choose which sections a blob holds (not how the state stores rows): they are
    # not compared with the state's, and `expected_sections` receives them as a second argument
    layout_flags: int = 0


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode(fmt: Format, state, flags: int, sections: list[Section], rows_of: Callable[[Section], torch.Tensor]) -> bytes:
    body = b"".join(_to_bytes(rows_of(s)) for s in sections)
    header = HEADER.pack(fmt.magic, VERSION, flags, state.fingerprint.encode().ljust(16, b"\0")[:16],
                         DTYPE_CODES[state.dtype], len(sections), state.pos, len(body), 0)
    table = b"".join(SECTION.pack(s.layer, s.kind, s.first, s.rows, s.width, s.dtype) for s in sections)
    payload = header + table + body
    return payload + hashlib.sha256(payload).digest()


def decode(fmt: Format, state, blob: bytes, *, flags_of_state: int,
           expected_sections: Callable[[int], list[Section]],
           flags_mismatch: Callable[[int], str] | None = None) -> tuple[int, list[tuple[Section, torch.Tensor]]]:
    """Check `blob` against `state` and return (pos, [(section, rows on the state's device)]).

    Refusals, in order: truncated; bad magic; unsupported version (or undefined flags / reserved
    bits); other model; other dtype (or other storage flags); counts inconsistent with pos; body
    size mismatch; checksum mismatch; pos beyond the state's capacity. Nothing is written here."""
    blob = bytes(blob)
    if len(blob) < HEADER.size:
        raise SnapshotTruncatedError(f"snapshot is {len(blob)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, flags, fp, dtype_code, n_sec, pos, body_len, reserved = HEADER.unpack_from(blob, 0)
    table_end = HEADER.size + n_sec * SECTION.size
    if magic == fmt.magic and len(blob) < table_end:
        raise SnapshotTruncatedError(f"snapshot is {len(blob)} bytes but its section table ends at {table_end}")
    if magic != fmt.magic:
        raise SnapshotMagicError(f"not a {fmt.what} snapshot (magic {magic!r}, expected {fmt.magic!r})")
    if version != VERSION:
        raise SnapshotVersionError(f"snapshot format version {version} is not supported (this kvfold reads "
                                   f"version {VERSION}); re-save it with a matching kvfold")
    if flags & ~fmt.known_flags or reserved:
        # a later format may give these meaning; reading them as version 1 would misread the blob
        raise SnapshotVersionError(f"snapshot uses header flags {flags:#x} / reserved {reserved:#x} that "
                                   f"format version {VERSION} does not define; re-save it with a matching kvfold")
    fp_str = fp.rstrip(b"\0").decode(errors="replace")
    if fp_str != state.fingerprint:
        raise SnapshotModelError(f"snapshot was taken from a model with config fingerprint {fp_str}; this state "
                                 f"belongs to {state.fingerprint}; restore it into a state of the same model")
    layout = flags & fmt.layout_flags
    if flags & ~fmt.layout_flags != flags_of_state:
        raise SnapshotDtypeError(flags_mismatch(flags) if flags_mismatch else
                                 f"snapshot storage flags {flags:#x} differ from this state's {flags_of_state:#x}")
    if CODE_DTYPES.get(dtype_code) != state.dtype:
        raise SnapshotDtypeError(f"snapshot dtype {CODE_DTYPES.get(dtype_code, dtype_code)} differs from the "
                                 f"state's {state.dtype}; load the model with the snapshot's dtype")
    got = [Section(*SECTION.unpack_from(blob, HEADER.size + i * SECTION.size)) for i in range(n_sec)]
    want = expected_sections(pos, layout) if fmt.layout_flags else expected_sections(pos)
    if got != want:
        if len(got) != len(want):
            detail = f"{len(got)} sections, expected {len(want)}"
        else:
            g, w = next((g, w) for g, w in zip(got, want) if g != w)
            name = fmt.kind_names[w.kind] if w.kind < len(fmt.kind_names) else f"kind {w.kind}"
            detail = (f"layer {w.layer} {name}: first={g.first} rows={g.rows} width={g.width}, "
                      f"expected first={w.first} rows={w.rows} width={w.width}")
        raise SnapshotCountsError(f"snapshot section table is inconsistent with pos={pos} ({detail})")
    need = sum(s.nbytes for s in want)
    if body_len != need or len(blob) != table_end + body_len + DIGEST:
        raise SnapshotSizeError(f"snapshot body size mismatch: table needs {need} body bytes, header says "
                                f"{body_len}, blob has {len(blob) - table_end - DIGEST} (missing or trailing bytes)")
    if hashlib.sha256(blob[:-DIGEST]).digest() != blob[-DIGEST:]:
        raise SnapshotChecksumError("snapshot checksum mismatch: the blob is corrupted")
    if pos > state.capacity:
        raise SnapshotCapacityError(f"snapshot is at pos {pos}, beyond this state's capacity {state.capacity}; "
                                    f"restore into model.new_state(capacity>={pos})")
    out, off = [], table_end
    for s in want:
        raw = torch.frombuffer(bytearray(blob[off:off + s.nbytes]), dtype=torch.uint8) if s.nbytes else \
            torch.empty(0, dtype=torch.uint8)
        out.append((s, raw.view(CODE_DTYPES[s.dtype]).reshape(s.rows, s.width).to(state.device)))
        off += s.nbytes
    return pos, out
