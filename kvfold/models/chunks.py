"""The chunk loop every model's `forward` shares: long inputs run as consecutive chunks (exact by
construction, since any split gives the same result), so memory stays bounded."""
from __future__ import annotations

from typing import Callable

import torch


def run_in_chunks(forward_chunk: Callable, ids: torch.Tensor, state, max_chunk: int, last_only: bool,
                  return_hidden: bool):
    """forward_chunk(chunk_ids, state, last_only) -> (logits, hidden streams) for one chunk."""
    t = ids.numel()
    logits, hidden = [], []
    with torch.inference_mode():  # no autograd bookkeeping: less per-op overhead in decode
        for c0 in range(0, t, max_chunk):
            chunk = ids[c0:c0 + max_chunk]
            lg, h = forward_chunk(chunk, state, last_only)
            if not last_only or c0 + len(chunk) == t:
                logits.append(lg)
            if return_hidden:
                hidden.append(h)
    # callers get ordinary tensors (inference tensors refuse in-place edits outside the mode)
    out = torch.cat(logits)
    return (out, torch.cat(hidden)) if return_hidden else out


def run_batch_in_rounds(forward_rows: Callable, pieces: list, max_chunk: int, last_only: bool | list[bool],
                        return_hidden: bool = False):
    """forward_rows([(chunk_ids, state), ...], flags) -> (logits per piece, streams): one model
    call per round, each round at most `max_chunk` more tokens of every piece still running.
    `last_only`: one flag for every piece, or one per piece (only its last row's logits).
    `return_hidden`: also each piece's final streams [T_i, ...] (pieces occupy consecutive rows)."""
    flags = [last_only] * len(pieces) if isinstance(last_only, bool) else list(last_only)
    outs: list[list[torch.Tensor]] = [[] for _ in pieces]
    hidden: list[list[torch.Tensor]] = [[] for _ in pieces]
    with torch.inference_mode():
        for c0 in range(0, max((ids.numel() for ids, _ in pieces), default=0), max_chunk):
            live = [(i, ids[c0:c0 + max_chunk], st) for i, (ids, st) in enumerate(pieces) if c0 < ids.numel()]
            live_flags = flags[0] if isinstance(last_only, bool) else [flags[i] for i, _, _ in live]
            logits, streams = forward_rows([(ids, st) for _, ids, st in live], live_flags)
            r = 0
            for (i, ids, _), lg in zip(live, logits):
                outs[i].append(lg)
                if return_hidden:
                    hidden[i].append(streams[r:r + ids.numel()])
                r += ids.numel()
    out = [o[-1] if last else torch.cat(o) for o, last in zip(outs, flags)]
    return (out, [torch.cat(h) for h in hidden]) if return_hidden else out
