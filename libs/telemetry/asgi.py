"""`TracedApp`: the gateway's HTTP edge of a trace, as an ASGI wrapper around the API app."""

# For each generation request (`POST /v1/chat/completions`, `/v1/completions`) it opens a SERVER span that
# is the root of the request's trace (or the child of the client's own `traceparent` header), and hands
# the span's traceparent to the app in place of the client's header, so the app, which already adopts
# that header as the context of what it sends on the bus, makes every later hop a child of this span.
# The span lasts until the response is fully sent (for SSE, until the last event), like the request.
#
# Metrics, in the app's registry: `moemesh_gateway_requests_received_total{endpoint}` counted on arrival,
# before the app sees the request (so `received == sum(moemesh_gateway_requests_total) + in flight`
# checks the app's own accounting), and `moemesh_gateway_e2e_request_latency_seconds{endpoint}` (vLLM's
# `e2e_request_latency_seconds`): arrival to the last byte sent.

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.telemetry.context import TRACEPARENT, context_from_headers, current_traceparent
from libs.telemetry.tracing import Telemetry

# path -> (endpoint label, as the gateway's own request counter names it; gen_ai.operation.name)
ENDPOINTS: Mapping[str, tuple[str, str]] = {
    "/v1/chat/completions": ("chat", "chat"),
    "/v1/completions": ("completions", "text_completion"),
}
_E2E = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_TP = TRACEPARENT.encode()


class TracedApp:
    """Wraps an ASGI app; requests to paths outside `endpoints` pass straight through."""

    def __init__(
        self,
        app: ASGIApp,
        telemetry: Telemetry,
        registry: CollectorRegistry,
        endpoints: Mapping[str, tuple[str, str]] = ENDPOINTS,
    ) -> None:
        self.app, self.telemetry, self.endpoints = app, telemetry, dict(endpoints)
        self.received = Counter(
            "moemesh_gateway_requests_received", "Generation requests arrived, by endpoint", ["endpoint"],
            registry=registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "moemesh_gateway_e2e_request_latency_seconds", "Arrival to the last byte of the response",
            ["endpoint"], buckets=_E2E, registry=registry,
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.endpoints.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        endpoint, operation = route
        t0 = time.perf_counter()
        self.received.labels(endpoint).inc()
        try:
            if not self.telemetry.enabled:
                await self.app(scope, receive, send)
            else:
                await self._traced(scope, receive, send, operation)
        finally:
            self.e2e.labels(endpoint).observe(time.perf_counter() - t0)

    async def _traced(self, scope: Scope, receive: Receive, send: Send, operation: str) -> None:
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
        client_tp = next((v.decode("latin-1") for k, v in headers if k.lower() == _TP), None)
        parent, _ = context_from_headers({TRACEPARENT: client_tp} if client_tp else None)
        method, path = scope.get("method", "POST"), scope["path"]
        attrs = {
            "http.request.method": method, "url.path": path, "gen_ai.operation.name": operation,
            "server.port": (scope.get("server") or ("", 0))[1] or 0,
        }  # fmt: skip
        with self.telemetry.span(
            f"{method} {path}", parent=parent, kind=SpanKind.SERVER, attributes=attrs
        ) as span:
            tp = current_traceparent()
            assert tp is not None  # the span's own, set by span()
            scope = {
                **scope,
                "headers": [(k, v) for k, v in headers if k.lower() != _TP] + [(_TP, tp.encode())],
            }

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                await send(message)

            await self.app(scope, receive, traced_send)
