"""Tracing helpers: configuration from the OTEL_* environment, spans as children of the bus traceparent,
the span's context as the outgoing traceparent, and the disabled (no-op) path."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, StatusCode

from libs.telemetry import CURRENT, Telemetry, annotate, mark_error, otlp_config, traceparent_of
from libs.telemetry.context import current_traceparent, new_traceparent, outgoing_headers, request_context


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tel(exporter: InMemorySpanExporter) -> Telemetry:
    t = Telemetry.with_exporter("scheduler", exporter, instance_id="scheduler-7")
    yield t
    t.shutdown()


def ids(tp: str) -> tuple[int, int]:
    _, trace_id, span_id, _ = tp.split("-")
    return int(trace_id, 16), int(span_id, 16)


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, None),  # no endpoint: nothing exported
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, ("otlp", "http/protobuf")),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ("otlp", "grpc"),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4317/",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "GRPC",
            },
            ("otlp", "grpc"),
        ),  # fmt: skip
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console", "")),
    ],
)
def test_otlp_config_follows_the_otel_environment(env, want) -> None:
    assert otlp_config(env) == want


@pytest.mark.parametrize(
    "env, names",
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ],
)  # fmt: skip
def test_unsupported_configuration_is_a_clear_error(env, names) -> None:
    with pytest.raises(ValueError, match=names):
        otlp_config(env)


@pytest.mark.parametrize("protocol, module", [("grpc", "grpc"), ("http/protobuf", "http")])
def test_from_env_builds_the_exporter_of_the_protocol(monkeypatch, protocol: str, module: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "not-this-one")
    t = Telemetry.from_env("decode-worker", "decode-3")
    try:
        assert t.enabled
        [proc] = t.provider._active_span_processor._span_processors
        exporter = proc._batch_processor._exporter
        assert type(exporter).__module__.startswith(f"opentelemetry.exporter.otlp.proto.{module}")
        attrs = t.provider.resource.attributes
        assert attrs["service.name"] == "decode-worker" and attrs["service.instance.id"] == "decode-3"
    finally:
        t.provider.shutdown = lambda: None  # nothing was recorded; do not wait on the unreachable endpoint
        t.shutdown()


def test_span_is_a_child_of_the_bus_traceparent_and_becomes_the_outgoing_one(tel, exporter) -> None:
    incoming = new_traceparent()
    with request_context(traceparent=incoming):
        with tel.span("scheduler.place", attributes={"moemesh.request_id": "r1"}) as span:
            inside = current_traceparent()
            headers = outgoing_headers()
        assert current_traceparent() == incoming  # restored after the block
    [s] = exporter.get_finished_spans()
    assert inside == traceparent_of(span) and headers == {"traceparent": inside}
    assert ids(inside)[0] == ids(incoming)[0]  # same trace
    assert s.parent is not None and s.parent.span_id == ids(incoming)[1] and s.parent.is_remote
    assert s.context.span_id == ids(inside)[1]
    assert s.resource.attributes["service.name"] == "scheduler"
    assert s.attributes["moemesh.request_id"] == "r1"


def test_explicit_parent_and_root(tel, exporter) -> None:
    tp = new_traceparent()
    with tel.span("child", parent=tp):
        pass
    with tel.span("root", parent=None):
        pass
    assert tel.start_span("skipped", parent=None, root=False) is INVALID_SPAN
    child, root = exporter.get_finished_spans()
    assert child.context.trace_id == ids(tp)[0] and child.parent.span_id == ids(tp)[1]
    assert root.parent is None and root.context.trace_id != ids(tp)[0]


def test_nested_spans_link_parent_to_child_and_record_errors(tel, exporter) -> None:
    with pytest.raises(RuntimeError), tel.span("outer", parent=None) as outer:
        with tel.span("inner") as inner:
            annotate(moemesh__bytes=42)
        assert current_traceparent() == traceparent_of(outer)
        raise RuntimeError("boom")
    inner_s, outer_s = exporter.get_finished_spans()
    assert inner_s.parent.span_id == outer_s.context.span_id
    assert inner_s.context.trace_id == outer_s.context.trace_id
    assert inner_s.attributes["moemesh.bytes"] == 42 and inner is not outer
    assert outer_s.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in outer_s.events)


def test_mark_error_on_a_handled_failure(tel, exporter) -> None:
    with tel.span("place", parent=None) as span:
        mark_error(span, "reservation refused")
    [s] = exporter.get_finished_spans()
    assert s.status.status_code is StatusCode.ERROR and "refused" in s.status.description


def test_spans_in_concurrent_tasks_keep_their_own_parents(tel, exporter) -> None:
    async def handler(tp: str) -> str | None:
        with request_context(traceparent=tp), tel.span("work"):
            await asyncio.sleep(0)
            return current_traceparent()

    async def main() -> list:
        return await asyncio.gather(*(handler(new_traceparent()) for _ in range(5)))

    inner = asyncio.run(main())
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 5
    assert sorted(ids(tp)[1] for tp in inner) == sorted(s.context.span_id for s in spans)


def test_disabled_telemetry_passes_the_context_through(monkeypatch) -> None:
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(k, raising=False)
    t = Telemetry.from_env("gateway")
    assert not t.enabled and t.provider is None
    tp = new_traceparent()
    with t.span("x") as span:
        assert span is INVALID_SPAN and current_traceparent() is None
    with t.span("x", parent=tp) as span:  # an explicit parent is still the one in force
        assert current_traceparent() == tp
        span.set_attribute("a", 1)  # no-op
        annotate(a=1)
    assert current_traceparent() is None
    assert t.start_span("y", parent=CURRENT) is INVALID_SPAN
    asyncio.run(t.aclose())  # nothing to flush
