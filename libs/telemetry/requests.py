"""Per-request span and outcome metrics of a worker role, kept in one place so they always agree."""

# A worker calls `start(rid, kind)` when a request becomes its own, `first_token(rid)` when it emits the
# first token, and `finish(rid, reason)` however it ends (finish reason, "cancelled", "error", ...);
# `request(rid, kind)` is the same as a `with` block for work that ends within one handler (a prefill).
# `finish` is idempotent and ignores unknown ids, so every path that may end a request can call it
# without double counting: `received_total == sum(finished_total) + running` always holds.
#
# Metric names (role = prefill | decode), after vLLM's / SGLang's where one exists:
# - `moemesh_<role>_requests_received_total{kind}`, `moemesh_<role>_requests_finished_total{reason}`
#   (vLLM `request_success_total{finished_reason}`), `moemesh_<role>_requests_running`
# - `moemesh_<role>_request_time_seconds` (received to finished on this worker)
# - `moemesh_<role>_time_to_first_token_seconds` (received to first token on this worker),
#   `moemesh_<role>_time_per_output_token_seconds` (first token to finish over the later tokens, vLLM's TPOT)
# - `moemesh_<role>_prefix_cache_queries_total` / `_hits_total` (prompt tokens looked up / found, as vLLM)
#   and `moemesh_<role>_prefix_cache_hit_rate` (hits / queries since start, as SGLang's cache_hit_rate)

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from opentelemetry.trace import Span, SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from libs.telemetry.tracing import CURRENT, AttributeValue, Telemetry, mark_error, use_span

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def reason_of(error: BaseException) -> str:
    """A bounded label for a failure: the exception class in snake case (`OutOfPagesError` ->
    `out_of_pages_error`, `Cancelled` -> `cancelled`)."""
    return _CAMEL.sub("_", type(error).__name__).lower()


@dataclass
class _Open:
    span: Span
    started: float
    first_token: float | None = None


class RequestTracker:
    """Spans and outcome counters of the requests one worker holds (see the module docstring)."""

    def __init__(
        self, telemetry: Telemetry, registry: CollectorRegistry, role: str, span_name: str | None = None
    ) -> None:
        if not re.fullmatch(r"[a-z_]+", role):
            raise ValueError(f"role must be a lower-case metric name part, got {role!r}")
        self.telemetry, self.role, self.span_name = telemetry, role, span_name or role
        self._open: dict[str, _Open] = {}
        self._cache = [0, 0]  # prompt tokens looked up, found
        p, r = f"moemesh_{role}", registry
        self.received = Counter(f"{p}_requests_received", "Requests taken on, by kind", ["kind"], registry=r)
        self.finished = Counter(
            f"{p}_requests_finished", "Requests ended, by reason (finish reason, cancelled, error type)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.running = Gauge(f"{p}_requests_running", "Requests taken on and not yet ended", registry=r)
        self.running.set_function(lambda: len(self._open))
        self.request_time = Histogram(
            f"{p}_request_time_seconds", "Received to ended, on this worker", buckets=_LATENCY, registry=r
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "Received to first token, on this worker",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            f"{p}_time_per_output_token_seconds", "First token to finish per later output token",
            buckets=_TPOT, registry=r,
        )  # fmt: skip
        self.cache_queries = Counter(f"{p}_prefix_cache_queries", "Prompt tokens looked up", registry=r)
        self.cache_hits = Counter(
            f"{p}_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.cache_hit_rate = Gauge(
            f"{p}_prefix_cache_hit_rate", "Prefix cache hits / queries since start", registry=r
        )
        self.cache_hit_rate.set_function(lambda: self._cache[1] / self._cache[0] if self._cache[0] else 0.0)

    def __contains__(self, rid: object) -> bool:
        return rid in self._open

    def start(
        self,
        rid: str,
        kind: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        parent: object = CURRENT,
    ) -> Span:
        """Take a request on: a span (child of the traceparent in force) and `received{kind}`. A second
        start of an id still open ends the first as `restarted`."""
        if rid in self._open:
            self.finish(rid, "restarted")
        attrs = {"moemesh.request_id": rid, "moemesh.kind": kind, **(attributes or {})}
        span = self.telemetry.start_span(
            self.span_name, parent=parent, kind=SpanKind.CONSUMER, attributes=attrs
        )
        self._open[rid] = _Open(span, time.perf_counter())
        self.received.labels(kind).inc()
        return span

    def span(self, rid: str) -> Span | None:
        o = self._open.get(rid)
        return None if o is None else o.span

    def first_token(self, rid: str) -> None:
        """The request's first output token left this worker (recorded once)."""
        o = self._open.get(rid)
        if o is None or o.first_token is not None:
            return
        o.first_token = time.perf_counter()
        self.ttft.observe(o.first_token - o.started)
        o.span.add_event("first_token")

    def prefix_cache(self, rid: str, cached_tokens: int, prompt_tokens: int) -> None:
        if cached_tokens < 0 or cached_tokens > prompt_tokens:
            raise ValueError(f"cached_tokens {cached_tokens} outside [0, prompt_tokens={prompt_tokens}]")
        self._cache[0] += prompt_tokens
        self._cache[1] += cached_tokens
        self.cache_queries.inc(prompt_tokens)
        self.cache_hits.inc(cached_tokens)
        o = self._open.get(rid)
        if o is not None:
            o.span.set_attribute("moemesh.cached_tokens", cached_tokens)

    def finish(
        self,
        rid: str,
        reason: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        error: BaseException | str | None = None,
        output_tokens: int | None = None,
    ) -> bool:
        """End a request: `finished{reason}`, its latency histograms, and its span (ERROR when `error`).
        False (and nothing counted) when the id is not open: already finished, or never started."""
        o = self._open.pop(rid, None)
        if o is None:
            return False
        now = time.perf_counter()
        self.finished.labels(reason).inc()
        self.request_time.observe(now - o.started)
        if o.first_token is not None and output_tokens is not None and output_tokens > 1:
            self.tpot.observe((now - o.first_token) / (output_tokens - 1))
        if o.span.is_recording():
            o.span.set_attribute("moemesh.finish_reason", reason)
            if output_tokens is not None:
                o.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
            if attributes:
                o.span.set_attributes(attributes)
            if error is not None:
                mark_error(o.span, error)
        o.span.end()
        return True

    @contextlib.contextmanager
    def request(
        self, rid: str, kind: str, attributes: Mapping[str, AttributeValue] | None = None
    ) -> Iterator[Span]:
        """start() + the span as the context in force for the block + finish(): `ok`, or the exception's
        reason_of() (the exception is recorded on the span and propagates)."""
        span = self.start(rid, kind, attributes)
        try:
            with use_span(span):
                yield span
        except BaseException as e:  # use_span recorded it on the span already
            self.finish(rid, reason_of(e))
            raise
        self.finish(rid, "ok")

    def close(self, reason: str = "shutdown") -> None:
        """End every open request (a worker going away)."""
        for rid in list(self._open):
            self.finish(rid, reason, error=reason)
