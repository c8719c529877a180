"""Per-request latency as histograms: time to first token and the time between later tokens,
with vLLM's metric semantics and bucket bounds (its `time_to_first_token_seconds` and
`inter_token_latency_seconds`), so a dashboard built for vLLM reads kvfold's /metrics.

Time to first token runs from `add_request` to the step that returns the request's first token;
an output of k tokens after the first contributes k observations of (time since the last
output) / k, as the tokens of a speculative step arrive together.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


@dataclass
class Histogram:
    """Cumulative-bucket counts as Prometheus exposes them (`le` upper bounds, then +Inf)."""
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.n += times

    def snapshot(self) -> tuple:
        """(bounds, cumulative counts including +Inf, sum, count): what `metrics` publishes."""
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return self.bounds, tuple(cumulative), self.total, self.n


class RequestLatency:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self._arrived: dict[str, float] = {}
        self._last: dict[str, float] = {}  # requests that have their first token

    def arrived(self, request_id: str) -> None:
        self._arrived[request_id] = self.clock()

    def forget(self, request_id: str) -> None:
        self._arrived.pop(request_id, None)
        self._last.pop(request_id, None)

    def observe(self, outputs) -> None:
        """One step's outputs (engine RequestOutputs)."""
        now = self.clock()
        for out in outputs:
            rid, k = out.request_id, len(out.new_token_ids)
            if k and rid in self._last:
                self.itl.observe((now - self._last[rid]) / k, k)
                self._last[rid] = now
            elif k and rid in self._arrived:
                self.ttft.observe(now - self._arrived[rid])
                if k > 1:  # a first output with drafts accepted at once
                    self.itl.observe(0.0, k - 1)
                self._last[rid] = now
            if out.finished:
                self.forget(rid)

    def metrics(self) -> dict:
        return {"time_to_first_token_seconds": self.ttft.snapshot(),
                "inter_token_latency_seconds": self.itl.snapshot()}
