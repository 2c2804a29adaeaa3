"""RequestTracker: spans and outcome counters that always add up, whatever path ends a request."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

from libs.telemetry import RequestTracker, Telemetry, reason_of, traceparent_of
from libs.telemetry.context import current_traceparent, new_traceparent, request_context


class Cancelled(Exception):
    pass


class OutOfPagesError(Exception):
    pass


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def tracker(exporter, registry) -> RequestTracker:
    return RequestTracker(Telemetry.with_exporter("decode-worker", exporter), registry, "decode")


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_reason_of_names_exception_types() -> None:
    assert reason_of(OutOfPagesError()) == "out_of_pages_error"
    assert reason_of(Cancelled()) == "cancelled"
    assert reason_of(ValueError()) == "value_error"


def test_counts_add_up_whichever_path_ends_a_request(tracker, registry, exporter) -> None:
    tp = new_traceparent()
    with request_context(traceparent=tp):
        tracker.start("a", "prefilled")
    tracker.start("b", "direct")
    tracker.start("c", "direct")
    assert value(registry, "moemesh_decode_requests_running") == 3
    tracker.first_token("a")
    tracker.first_token("a")  # once
    assert tracker.finish("a", "length", output_tokens=5)
    assert not tracker.finish("a", "cancelled")  # ended already: not counted twice
    assert not tracker.finish("never-started", "error")
    assert tracker.finish("b", "cancelled")
    assert tracker.finish("c", "error", error="decode step failed")
    received = sum(
        value(registry, "moemesh_decode_requests_received_total", kind=k) for k in ("prefilled", "direct")
    )
    finished = sum(
        value(registry, "moemesh_decode_requests_finished_total", reason=r)
        for r in ("length", "cancelled", "error")
    )
    assert received == finished == 3
    assert value(registry, "moemesh_decode_requests_running") == 0
    assert value(registry, "moemesh_decode_time_per_output_token_seconds_count") == 1
    assert value(registry, "moemesh_decode_time_to_first_token_seconds_count") == 1
    spans = {s.attributes["moemesh.request_id"]: s for s in exporter.get_finished_spans()}
    a, c = spans["a"], spans["c"]
    assert a.parent.span_id == int(tp.split("-")[2], 16)
    assert [e.name for e in a.events] == ["first_token"]
    assert (
        a.attributes["gen_ai.usage.output_tokens"] == 5 and a.attributes["moemesh.finish_reason"] == "length"
    )
    assert c.status.status_code is StatusCode.ERROR and spans["b"].status.status_code is StatusCode.UNSET


def test_request_block_sets_the_context_and_counts_failures_by_type(tracker, registry, exporter) -> None:
    with tracker.request("p1", "prefill") as span:
        assert current_traceparent() == traceparent_of(span)
        tracker.prefix_cache("p1", 16, 40)
    with pytest.raises(OutOfPagesError), tracker.request("p2", "prefill"):
        raise OutOfPagesError("no pages")
    assert value(registry, "moemesh_decode_requests_finished_total", reason="ok") == 1
    assert value(registry, "moemesh_decode_requests_finished_total", reason="out_of_pages_error") == 1
    assert value(registry, "moemesh_decode_prefix_cache_hit_rate") == pytest.approx(0.4)
    assert value(registry, "moemesh_decode_prefix_cache_hits_total") == 16
    p1, p2 = exporter.get_finished_spans()
    assert p1.attributes["moemesh.cached_tokens"] == 16
    assert p2.status.status_code is StatusCode.ERROR


def test_prefix_cache_rejects_impossible_counts(tracker) -> None:
    with pytest.raises(ValueError, match="cached_tokens"):
        tracker.prefix_cache("x", 5, 4)


def test_restart_and_close_end_open_requests(tracker, registry) -> None:
    tracker.start("a", "direct")
    tracker.start("a", "direct")  # the same id again: the first ends as restarted
    tracker.start("b", "direct")
    tracker.close()
    assert value(registry, "moemesh_decode_requests_finished_total", reason="restarted") == 1
    assert value(registry, "moemesh_decode_requests_finished_total", reason="shutdown") == 2
    assert value(registry, "moemesh_decode_requests_received_total", kind="direct") == 3


def test_disabled_tracker_still_counts(registry) -> None:
    t = RequestTracker(Telemetry.disabled("prefill-worker"), registry, "prefill")
    with t.request("r", "prefill"):
        assert current_traceparent() is None
    assert value(registry, "moemesh_prefill_requests_finished_total", reason="ok") == 1


def test_role_must_be_a_metric_name_part(registry) -> None:
    with pytest.raises(ValueError, match="role"):
        RequestTracker(Telemetry.disabled(), registry, "decode-worker")
