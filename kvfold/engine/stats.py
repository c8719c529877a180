"""What `Engine.metrics()` reports, gathered from the engine's parts (server/metrics.py renders it)."""
from __future__ import annotations

from .disk_cache import disk_stats
from .graphs import GRAPH_STATS
from .prefix_cache import PrefixCache


def engine_metrics(engine) -> dict[str, float]:
    """`Engine.metrics()`: the engine's counters, its queue and states, the page pool, graph
    decode, speculation, the prefix cache with its disk tier, and request latency."""
    c = engine._c
    m: dict[str, float] = dict(c)
    live = [s for s in engine.scheduler.running if s.state is not None]
    m.update(
        queue_depth=len(engine.scheduler.waiting),
        running=len(engine.scheduler.running),
        live_states=c["states_allocated"] - c["states_freed"],
        live_state_bytes=sum(s.state.nbytes for s in live),
        reserved_state_bytes=engine.scheduler.reserved_bytes,
        spec_draft_tokens=engine.spec.drafted if engine.spec is not None else 0,
        spec_accepted_tokens=engine.spec.accepted if engine.spec is not None else 0,
        spec_drafts=engine.spec.verifies if engine.spec is not None else 0,
        spec_accepted_per_position=tuple(engine.spec.accepted_at) if engine.spec is not None else (),
        max_running=engine.scheduler.max_running,
    )
    # a placed model's partial expert packs (models/split_experts.py): routed (row, slot) pairs the
    # card served, of all those routed in layers with a pack
    m["expert_card_hits"], m["expert_routed_slots"] = engine.model.expert_hits()
    m.update(dict.fromkeys(("pages_total", "pages_used", "pages_free", "pages_shared", "page_bytes",
                            "page_bytes_total", "page_bytes_used"), 0))
    if engine.pages is not None:
        m.update(engine.pages.stats())
    m.update(engine.graphs.stats() if engine.graphs is not None else dict.fromkeys(GRAPH_STATS, 0))
    pc = engine.prefix_cache or PrefixCache(engine.prefill_chunk, 0)  # disabled: an empty cache's
    m.update(pc.stats(), **disk_stats(pc.disk), **engine.latency.metrics())
    return m
