"""Prometheus metrics of one gateway process (own registry, so several apps in one test process never
collide): requests by endpoint and status, TTFT, inter-token latency, in-flight, tokens."""

# The per-token ones (output tokens, inter-token latency) are plain counts in `StreamTally`, exposed by a
# collector under prometheus_client's names and types: a Counter.inc or Histogram.observe (lock, exemplar
# checks) twice per streamed token is a cost on the hottest path.

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Latency buckets in seconds: sub-millisecond mesh overhead up to long CPU prefills.
_TTFT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class StreamTally(Collector):
    """Output tokens and the inter-token latency histogram, counted by the event loop's thread alone."""

    def __init__(self, itl_buckets: tuple[float, ...]) -> None:
        self.bounds = itl_buckets
        self.itl_counts = [0] * (len(itl_buckets) + 1)  # the last: above every bound (+Inf)
        self.itl_sum = 0.0
        self.tokens = 0

    def itl(self, gap: float, n: int) -> None:
        """n tokens that came `gap` seconds apart each (Histogram.observe(gap), n times)."""
        self.itl_counts[bisect_left(self.bounds, gap)] += n  # the first bound >= gap, as observe picks
        self.itl_sum += gap * n

    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily("moemesh_gateway_generation_tokens", "Output tokens returned to clients")
        tokens.add_metric([], self.tokens)
        yield tokens
        cum, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.itl_counts, strict=True):
            cum += n
            buckets.append((floatToGoString(bound), cum))
        yield HistogramMetricFamily(
            "moemesh_gateway_itl_seconds", "Time between output tokens of one choice", buckets=buckets,
            sum_value=self.itl_sum,
        )  # fmt: skip


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "moemesh_gateway_requests", "Finished HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "moemesh_gateway_ttft_seconds", "Arrival to first output token", buckets=_TTFT, registry=r
        )
        self.tally = StreamTally(_ITL)  # output tokens and inter-token latency
        r.register(self.tally)
        self.in_flight = Gauge(
            "moemesh_gateway_requests_in_flight", "HTTP generation requests running", registry=r
        )
        self.prompt_tokens = Counter("moemesh_gateway_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.migrations = Counter(
            "moemesh_gateway_migrations",
            "Choices re-submitted (prompt + tokens so far) after losing their worker",
            registry=r,
        )
        self.mesh_in_flight = Gauge(
            "moemesh_gateway_mesh_requests_in_flight",
            "Mesh requests awaiting tokens (one per choice)",
            registry=r,
        )

    def track_mesh_in_flight(self, fn: Callable[[], float]) -> None:
        self.mesh_in_flight.set_function(fn)
