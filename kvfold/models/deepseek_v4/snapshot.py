"""Snapshots of a Dsv4State: only the rows still in use at `pos`, in the shared framing of
`blob.py` (magic `KVFOLDST`; format and refusal order in docs/state-format.md)."""
from __future__ import annotations

import torch

from ...state import blob
from ...state.blob import DTYPE_CODES, Section
from ...state.pages import check_restore_pages, shared_tokens
from ...state.rings import PositionRing

FLAG_FP8_KV = blob.FLAG_FP8_KV  # window rows and compressed entries are stored in FP8 (the blob holds them decoded)
FLAG_NO_POOLS = blob.FLAG_NO_POOLS  # pool sections without the rows of the whole pages before pos

# section kinds
WINDOW, COMP_KV, COMP_SCORE, COMP_POOL, IX_KV, IX_SCORE, IX_POOL = range(7)
KIND_NAMES = ["window", "compressor kv", "compressor score", "compressed pool",
              "indexer kv", "indexer score", "indexer pool"]
FORMAT = blob.Format(magic=b"KVFOLDST", what="kvfold state", kind_names=KIND_NAMES, known_flags=FLAG_FP8_KV | FLAG_NO_POOLS,
                    layout_flags=FLAG_NO_POOLS)
MAGIC = FORMAT.magic
_HEADER = blob.HEADER


def _flags(state) -> int:
    return FLAG_FP8_KV if getattr(state, "kv_fp8", False) else 0


def _buffers(ls, kind):
    """(kind -> KvRows or PositionRing) of one layer, for the kinds this layer has."""
    out = {WINDOW: ls.window}
    if ls.compressor is not None:
        out.update({COMP_KV: ls.compressor.kv, COMP_SCORE: ls.compressor.score, COMP_POOL: ls.compressor.pool})
    if ls.indexer is not None:
        out.update({IX_KV: ls.indexer.kv, IX_SCORE: ls.indexer.score, IX_POOL: ls.indexer.pool})
    return out.get(kind)


def expected_sections(state, pos: int, layout: int = 0) -> list[Section]:
    """The sections a snapshot at `pos` holds for a state of this geometry (with FLAG_NO_POOLS
    in `layout`: pool sections start after the `shared_tokens`)."""
    skip = shared_tokens(state, pos) if layout & FLAG_NO_POOLS else 0
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
            secs.append(Section(i, kinds[2], skip // r, pos // r - skip // r, comp.pool.width, sd))
    return secs


def _rows_of(state, s: Section) -> torch.Tensor:
    buf = _buffers(state.layers[s.layer], s.kind)
    if isinstance(buf, PositionRing):
        return buf.read(s.first, s.first + s.rows)
    return buf[s.first:s.first + s.rows]  # a pool: private KvRows or PagedRows


def encode(state, pools: bool = True) -> bytes:
    layout = 0 if pools else FLAG_NO_POOLS
    return blob.encode(FORMAT, state, _flags(state) | layout, expected_sections(state, state.pos, layout),
                       lambda s: _rows_of(state, s))


def decode_and_apply(state, data: bytes) -> None:
    pos, sections = blob.decode(FORMAT, state, data, flags_of_state=_flags(state),
                                expected_sections=lambda p, layout: expected_sections(state, p, layout))
    flags = blob.HEADER.unpack_from(data, 0)[2]
    check_restore_pages(state, pos, bool(flags & FLAG_NO_POOLS))
    # every check passed: write (rows are placed by position)
    for s, rows in sections:
        buf = _buffers(state.layers[s.layer], s.kind)
        if isinstance(buf, PositionRing):
            buf.write(s.first, rows)
        else:
            buf[s.first:s.first + s.rows] = rows
    state.pos = state.written_until = state.rewind_floor = pos
