"""An engine's limits, checked before anything is built, and the size of its shared page pool."""
from __future__ import annotations

import math
from typing import Any

BLOCK = 128  # snapshot and prefix boundaries: no HCA partial state there, and a multiple of the k-pool


def check_limits(model: Any, *, max_seq_len: int, max_running: int, max_queue: int, max_batch_tokens: int,
                 prefill_chunk: int, prefix_cache_bytes: int, kv_page_bytes: int | None,
                 batch_invariant: bool | None, decode_graphs: bool) -> bool:
    """ValueError for limits an engine cannot run with; returns the batch-invariant mode to set:
    `batch_invariant`, or for None the model's default (`invariant_by_default`), except with
    graph decode, which keeps the mode only where the model says so (`graph_unsupported`, asked
    by DecodeGraphs.for_engine)."""
    if prefill_chunk < BLOCK or prefill_chunk % BLOCK:
        raise ValueError(f"prefill_chunk must be a positive multiple of {BLOCK}, got {prefill_chunk}")
    if max_batch_tokens < max_running:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must cover one decode token per running "
                         f"sequence (max_running={max_running})")
    for name, v in (("max_seq_len", max_seq_len), ("max_running", max_running)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if max_queue < 0 or prefix_cache_bytes < 0 or (kv_page_bytes is not None and kv_page_bytes < 0):
        raise ValueError("max_queue, prefix_cache_bytes and kv_page_bytes must be >= 0")
    limit = model.config.max_position_embeddings
    if limit is not None and max_seq_len > limit:
        raise ValueError(f"max_seq_len {max_seq_len} passes the model's max_position_embeddings {limit}")
    if batch_invariant is None:
        batch_invariant = model.invariant_by_default and not decode_graphs
    return batch_invariant


def page_pool(model: Any, kv_page_bytes: int | None, max_running: int, max_seq_len: int, max_state_bytes: float,
               prefill_chunk: int, extra: int = 0):
    """The engine's shared page pool, or None (private pools: models without the `pages`
    capability, kv_page_bytes=0, or a prefill chunk that is not a whole number of pages)."""
    if not model.capabilities.pages or kv_page_bytes == 0:
        return None
    if prefill_chunk % model.page_tokens:
        return None  # cache boundaries must fall on page boundaries to share pages
    page_bytes = model.new_page_pool(0).page_bytes
    if page_bytes == 0:  # no compressed pools (sliding layers only): nothing to page
        return None
    per_seq = -(-max_seq_len // model.page_tokens)
    if kv_page_bytes is not None:
        n = kv_page_bytes // page_bytes
    else:
        n = max_running * per_seq
        if max_state_bytes != math.inf:
            n = min(n, max(per_seq, int(max_state_bytes) // page_bytes))
    return model.new_page_pool(n + extra)
