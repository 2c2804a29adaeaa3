"""TracedApp around a small Starlette app: the SERVER span, the traceparent the app sees, the metrics."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from libs.telemetry import Telemetry
from libs.telemetry.asgi import TracedApp
from libs.telemetry.context import new_traceparent

seen: list[str | None] = []


async def completions(request: Request) -> JSONResponse:
    seen.append(request.headers.get("traceparent"))
    return JSONResponse({"ok": True}, status_code=int(request.query_params.get("status", 200)))


async def chat(request: Request) -> StreamingResponse:
    seen.append(request.headers.get("traceparent"))

    async def events():
        for i in range(3):
            yield f"data: {i}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


APP = Starlette(
    routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health),
    ]
)


@pytest.fixture(autouse=True)
def _clear_seen():
    seen.clear()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_generation_requests_get_a_server_span_whose_context_the_app_sees() -> None:
    exporter, registry = InMemorySpanExporter(), CollectorRegistry()
    app = TracedApp(APP, Telemetry.with_exporter("gateway", exporter), registry)
    client_tp = new_traceparent()
    async with client(app) as c:
        r1 = await c.post("/v1/completions", json={}, headers={"traceparent": client_tp})
        r2 = await c.post("/v1/chat/completions", json={})
        r3 = await c.post("/v1/completions?status=503", json={})
        assert (await c.get("/health")).status_code == 200
    assert (r1.status_code, r2.status_code, r3.status_code) == (200, 200, 503)
    assert r2.text.count("data:") == 3
    s1, s2, s3 = exporter.get_finished_spans()  # /health is not traced
    assert s1.kind is SpanKind.SERVER and s1.name == "POST /v1/completions"
    assert s1.context.trace_id == int(client_tp.split("-")[1], 16)
    assert s1.parent.span_id == int(client_tp.split("-")[2], 16)
    assert s2.parent is None  # no client context: the request starts the trace
    for tp, s in zip(seen, (s1, s2, s3), strict=True):
        _, trace_id, span_id, _ = tp.split("-")  # the app sees the span's context, not the client's
        assert (int(trace_id, 16), int(span_id, 16)) == (s.context.trace_id, s.context.span_id)
    assert s2.attributes["gen_ai.operation.name"] == "chat"
    assert s1.attributes["http.response.status_code"] == 200
    assert s3.status.status_code is StatusCode.ERROR
    assert count(registry, "moemesh_gateway_requests_received_total", endpoint="completions") == 2
    assert count(registry, "moemesh_gateway_requests_received_total", endpoint="chat") == 1
    assert count(registry, "moemesh_gateway_e2e_request_latency_seconds_count", endpoint="chat") == 1


async def test_disabled_tracing_leaves_headers_alone_and_still_counts() -> None:
    registry = CollectorRegistry()
    app = TracedApp(APP, Telemetry.disabled("gateway"), registry)
    client_tp = new_traceparent()
    async with client(app) as c:
        await c.post("/v1/completions", json={}, headers={"traceparent": client_tp})
        await c.post("/v1/completions", json={})
    assert seen == [client_tp, None]
    assert count(registry, "moemesh_gateway_requests_received_total", endpoint="completions") == 2
    assert count(registry, "moemesh_gateway_e2e_request_latency_seconds_count", endpoint="completions") == 2
