"""Prometheus metrics of one gateway process (own registry, so several apps in one test process
never collide): requests by endpoint and status, TTFT, inter-token latency, in-flight, tokens."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets in seconds: sub-millisecond mesh overhead up to long CPU prefills.
_TTFT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


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
        self.itl = Histogram(
            "moemesh_gateway_itl_seconds",
            "Time between output tokens of one choice",
            buckets=_ITL,
            registry=r,
        )
        self.in_flight = Gauge(
            "moemesh_gateway_requests_in_flight", "HTTP generation requests running", registry=r
        )
        self.prompt_tokens = Counter("moemesh_gateway_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter(
            "moemesh_gateway_generation_tokens", "Output tokens returned to clients", registry=r
        )
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
