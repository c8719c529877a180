"""Engine metrics in the Prometheus text exposition format (version 0.0.4)."""
from __future__ import annotations

from typing import Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (engine metric key, prometheus name, type, help); labels are written into the name
_METRICS = [
    ("requests_added", "kvfold_requests_total", "counter", "Requests accepted into the engine."),
    ("requests_rejected", "kvfold_requests_rejected_total", "counter",
     "Requests refused before any work (invalid, over capacity, queue full)."),
    ("requests_cancelled", "kvfold_requests_cancelled_total", "counter",
     "Requests cancelled (e.g. client disconnected)."),
    ("finished_stop", 'kvfold_requests_finished_total{reason="stop"}', "counter", "Requests finished, by reason."),
    ("finished_length", 'kvfold_requests_finished_total{reason="length"}', "counter", None),
    ("finished_error", 'kvfold_requests_finished_total{reason="error"}', "counter", None),
    ("prompt_tokens", "kvfold_prompt_tokens_total", "counter", "Prompt tokens of accepted requests (tokens in)."),
    ("prefill_tokens", "kvfold_prefill_tokens_total", "counter",
     "Prompt tokens actually computed (prefix-cache hits excluded)."),
    ("generation_tokens", "kvfold_generation_tokens_total", "counter", "Generated tokens (tokens out)."),
    ("steps", "kvfold_engine_steps_total", "counter", "Batched forward calls."),
    ("batch_seqs", "kvfold_batch_sequences_total", "counter", "Sequences advanced, summed over steps."),
    ("batch_tokens", "kvfold_batch_tokens_total", "counter", "Tokens fed, summed over steps."),
    ("queue_depth", "kvfold_queue_depth", "gauge", "Requests waiting for admission."),
    ("running", "kvfold_running_sequences", "gauge", "Sequences holding a state."),
    ("last_batch_seqs", "kvfold_batch_size", "gauge", "Sequences in the last batched forward."),
    ("last_batch_tokens", "kvfold_batch_tokens", "gauge", "Tokens in the last batched forward."),
    ("live_states", "kvfold_live_states", "gauge", "Per-sequence states allocated and not yet freed."),
    ("live_state_bytes", "kvfold_state_bytes", "gauge", "Bytes held by live per-sequence states."),
    ("prefix_cache_lookups", "kvfold_prefix_cache_lookups_total", "counter", "Prefix-cache lookups."),
    ("prefix_cache_hits", "kvfold_prefix_cache_request_hits_total", "counter", "Lookups that restored a snapshot."),
    ("prefix_cache_lookup_tokens", "kvfold_prefix_cache_queried_tokens_total", "counter",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "kvfold_prefix_cache_hit_tokens_total", "counter",
     "Prompt tokens restored from the prefix cache."),
    ("prefix_cache_hit_rate", "kvfold_prefix_cache_hit_rate", "gauge", "Hit tokens / looked-up prompt tokens."),
    ("prefix_cache_request_hit_rate", "kvfold_prefix_cache_request_hit_rate", "gauge", "Hits / lookups."),
    ("prefix_cache_entries", "kvfold_prefix_cache_entries", "gauge", "Snapshots held by the prefix cache."),
    ("prefix_cache_bytes", "kvfold_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache."),
    ("prefix_cache_evictions", "kvfold_prefix_cache_evictions_total", "counter", "Snapshots evicted (LRU)."),
    ("prefix_cache_pages", "kvfold_prefix_cache_pages", "gauge", "KV pages referenced by the prefix cache."),
    ("prefix_cache_disk_hits", "kvfold_prefix_cache_disk_hits_total", "counter",
     "Requests resumed from a prefix-cache entry on disk."),
    ("prefix_cache_disk_hit_tokens", "kvfold_prefix_cache_disk_hit_tokens_total", "counter",
     "Prompt tokens restored from disk entries."),
    ("prefix_cache_disk_writes", "kvfold_prefix_cache_disk_writes_total", "counter",
     "Prefix-cache entries written to disk."),
    ("prefix_cache_disk_evictions", "kvfold_prefix_cache_disk_evictions_total", "counter",
     "Disk entries deleted to keep the disk budget (LRU)."),
    ("prefix_cache_disk_refused", "kvfold_prefix_cache_disk_refused_total", "counter",
     "Disk entries that failed their checks: deleted, never served."),
    ("prefix_cache_disk_write_errors", "kvfold_prefix_cache_disk_write_errors_total", "counter",
     "Disk writes that failed (a full disk): the entry stays absent."),
    ("prefix_cache_disk_entries", "kvfold_prefix_cache_disk_entries", "gauge", "Prefix-cache entries on disk."),
    ("prefix_cache_disk_bytes", "kvfold_prefix_cache_disk_bytes", "gauge", "Bytes of the disk entries."),
    ("pages_total", "kvfold_kv_pages", "gauge", "Pages of the shared compressed-KV page pool."),
    ("pages_used", "kvfold_kv_pages_used", "gauge", "Pages referenced by a sequence or the prefix cache."),
    ("pages_free", "kvfold_kv_pages_free", "gauge", "Pages free for new sequences."),
    ("pages_shared", "kvfold_kv_pages_shared", "gauge", "Pages referenced more than once (shared prefixes)."),
    ("page_bytes_total", "kvfold_kv_page_bytes", "gauge", "Bytes of the page pool (preallocated)."),
    ("page_bytes_used", "kvfold_kv_page_bytes_used", "gauge", "Bytes of the pages in use."),
    ("spec_draft_tokens", "kvfold_spec_decode_draft_tokens_total", "counter", "Draft tokens proposed and verified."),
    ("spec_accepted_tokens", "kvfold_spec_decode_accepted_tokens_total", "counter", "Draft tokens accepted."),
    ("expert_card_hits", "kvfold_expert_card_hits_total", "counter",
     "Routed (token, expert) pairs a card layer's partial expert pack served on the card."),
    ("expert_routed_slots", "kvfold_expert_routed_total", "counter",
     "Routed (token, expert) pairs in card layers with a partial expert pack (hit rate: hits / this)."),
    (lambda m: m["expert_card_hits"] / m["expert_routed_slots"] if m.get("expert_routed_slots") else 0,
     "kvfold_expert_card_hit_ratio", "gauge", "Share of routed pairs in partial-pack layers served on the card."),
    ("graph_steps", "kvfold_graph_steps_total", "counter", "Decode steps run by graph decode (--decode-graphs)."),
    ("graph_draft_rows", "kvfold_graph_draft_rows_total", "counter",
     "Draft tokens verified in graph-decode steps (rows past each sequence's first)."),
    ("graph_replays", "kvfold_graph_replays_total", "counter", "Graph-decode steps replayed from a CUDA graph."),
    ("graph_captures", "kvfold_graph_captures_total", "counter", "Batch buckets captured (or set up, on the CPU)."),
    ("graph_recaptures", "kvfold_graph_recaptures_total", "counter",
     "Captures redone because a tensor the graph read had moved."),
    ("graph_capture_errors", "kvfold_graph_capture_errors_total", "counter",
     "Captures that failed (that bucket then runs eagerly)."),
]


# vLLM's metric semantics under vLLM's names after the prefix (docs/serving.md, "Metrics"), so a
# dashboard built for vLLM's /metrics reads kvfold's: (engine key or a function of the metrics, name, type, help)
_VLLM = [
    ("running", "kvfold_num_requests_running", "gauge", "Requests running (holding a state)."),
    ("queue_depth", "kvfold_num_requests_waiting", "gauge", "Requests waiting for admission."),
    (lambda m: m.get("pages_used", 0) / m["pages_total"] if m.get("pages_total")
     else m.get("running", 0) / max(1, m.get("max_running", 1)),
     "kvfold_kv_cache_usage_perc", "gauge",
     "KV-cache usage, 1 = full: pages in use of the shared page pool (private pools: states of max_running)."),
    ("prefix_cache_lookup_tokens", "kvfold_prefix_cache_queries_total", "counter",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "kvfold_prefix_cache_hits_total", "counter",
     "Prompt tokens restored from the prefix cache (memory or disk)."),
    ("spec_drafts", "kvfold_spec_decode_num_drafts_total", "counter", "Verify steps of sequences with drafts."),
    ("spec_draft_tokens", "kvfold_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed."),
    ("spec_accepted_tokens", "kvfold_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    (lambda m: 1 + m.get("spec_accepted_tokens", 0) / m["spec_drafts"] if m.get("spec_drafts") else 0,
     "kvfold_spec_decode_mean_accepted_length", "gauge",
     "Tokens a verify step with drafts emits on average: 1 + accepted / verify steps (0 before any)."),
]
_HISTOGRAMS = [
    ("time_to_first_token_seconds", "kvfold_time_to_first_token_seconds",
     "Time from a request's arrival to its first token."),
    ("inter_token_latency_seconds", "kvfold_inter_token_latency_seconds", "Time between a request's later tokens."),
]


def render(metrics: Mapping[str, float], http_errors: Mapping[int, int] | None = None) -> str:
    lines = []
    for key, name, kind, help_text in _METRICS + _VLLM:
        base = name.split("{")[0]
        if help_text is not None:
            lines += [f"# HELP {base} {help_text}", f"# TYPE {base} {kind}"]
        lines.append(f"{name} {_num(key(metrics) if callable(key) else metrics.get(key, 0))}")
    lines += ["# HELP kvfold_spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted, by draft position.",
              "# TYPE kvfold_spec_decode_num_accepted_tokens_per_pos_total counter"]
    for pos, n in enumerate(metrics.get("spec_accepted_per_position", ())):
        lines.append(f'kvfold_spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} {n}')
    for key, name, help_text in _HISTOGRAMS:
        lines += _histogram(name, help_text, metrics.get(key))
    lines += ["# HELP kvfold_http_errors_total Error responses, by HTTP status.",
              "# TYPE kvfold_http_errors_total counter"]
    for status, n in sorted((http_errors or {}).items()):
        lines.append(f'kvfold_http_errors_total{{status="{status}"}} {n}')
    return "\n".join(lines) + "\n"


def _histogram(name: str, help_text: str, snap) -> list[str]:
    """A histogram's lines from `latency.Histogram.snapshot()` (bounds, cumulative counts with
    +Inf last, sum, count); an empty one without it."""
    bounds, cumulative, total, n = snap if snap is not None else ((), (0,), 0.0, 0)
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for le, c in zip([_num(b) for b in bounds] + ["+Inf"], cumulative):
        lines.append(f'{name}_bucket{{le="{le}"}} {c}')
    return lines + [f"{name}_sum {_num(total)}", f"{name}_count {n}"]


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def parse(text: str) -> dict[str, float]:
    """Samples of a text exposition as {name-with-labels: value} (for tests and quick checks)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
