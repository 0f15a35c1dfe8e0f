"""An engine's metrics in the shapes of vLLM's `vllm.v1.metrics.reader` (`LLM.get_metrics`):
counters, gauges and histograms under vLLM's metric names, so a script that reads
vLLM's reads these. They are kept in the engine (no Prometheus registry): requests and
tokens counted, and each finished request's latencies (from its `RequestMetrics`) and
lengths observed into histograms.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from dataclasses import dataclass, field

from offload.core.outputs import GenerationStats, RequestOutput


@dataclass
class Metric:
    """A metric: its name and its labels (vLLM's `Metric`)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of counters (vLLM's, for speculative decoding: none here)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations counted in buckets: {upper bound as text: count at or below it},
    '+Inf' last (cumulative, as Prometheus's)."""

    count: int
    sum: float
    buckets: dict[str, int]


# bucket bounds: seconds (an offloaded request may take hours) and token counts
SECONDS_BOUNDS = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                  1800.0, 3600.0, 7200.0)  # fmt: skip
TOKEN_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


@dataclass
class _Observed:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def histogram(self, name: str) -> Histogram:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        running, buckets = 0, {}
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            running += count
            buckets[bound] = running
        return Histogram(name, {}, running, self.total, buckets)


@dataclass
class EngineMetrics:
    """What `LLM.get_metrics` reports: kept as requests finish (`observe`)."""

    stats: GenerationStats
    finished: Tally = field(default_factory=Tally)  # by finish reason
    ttft: _Observed = field(default_factory=lambda: _Observed(SECONDS_BOUNDS))
    e2e: _Observed = field(default_factory=lambda: _Observed(SECONDS_BOUNDS))
    queue: _Observed = field(default_factory=lambda: _Observed(SECONDS_BOUNDS))
    prompt_len: _Observed = field(default_factory=lambda: _Observed(TOKEN_BOUNDS))
    generation_len: _Observed = field(default_factory=lambda: _Observed(TOKEN_BOUNDS))

    def observe(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self.finished[out.finish_reason] += 1  # (a request: its first sample's)
            self.prompt_len.observe(len(out.prompt_token_ids))
            self.generation_len.observe(out.completion_tokens)
            m = out.metrics
            if m is None:
                continue
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            if m.time_in_queue is not None:
                self.queue.observe(m.time_in_queue)

    def snapshot(self) -> list[Metric]:
        s = self.stats
        out: list[Metric] = [
            Gauge("vllm:num_requests_running", {}, 0.0),
            Gauge("vllm:num_requests_waiting", {}, 0.0),
            Counter("vllm:prompt_tokens", {}, s.prompt_tokens),
            Counter("vllm:generation_tokens", {}, s.generated_tokens),
        ]
        for reason in ("stop", "length"):
            labels = {"finished_reason": reason}
            out.append(Counter("vllm:request_success", labels, self.finished[reason]))
        out += [
            self.ttft.histogram("vllm:time_to_first_token_seconds"),
            self.e2e.histogram("vllm:e2e_request_latency_seconds"),
            self.queue.histogram("vllm:request_queue_time_seconds"),
            self.prompt_len.histogram("vllm:request_prompt_tokens"),
            self.generation_len.histogram("vllm:request_generation_tokens"),
        ]
        return out
