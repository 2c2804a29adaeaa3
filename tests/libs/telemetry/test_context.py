import pytest

from libs.bus import (
    DEADLINE,
    TRACEPARENT,
    current_deadline,
    new_traceparent,
    now_ms,
    request_context,
    time_left,
)
from libs.telemetry.context import context_from_headers, incoming_context, outgoing_headers


def test_no_context_means_no_headers():
    assert current_deadline() is None and time_left() is None
    assert outgoing_headers() is None
    assert outgoing_headers({"x": "1"}) == {"x": "1"}


def test_nested_deadlines_only_tighten():
    with request_context(timeout=10.0):
        outer = current_deadline()
        assert 9.0 < time_left() <= 10.0
        with request_context(timeout=100.0):
            assert current_deadline() == outer  # a looser inner timeout does not extend it
        with request_context(deadline_ms=outer - 5000):
            assert current_deadline() == outer - 5000
        assert current_deadline() == outer
    assert current_deadline() is None


def test_outgoing_headers_carry_trace_and_deadline():
    tp = new_traceparent()
    with request_context(traceparent=tp, deadline_ms=now_ms() + 1000):
        h = outgoing_headers()
        assert h[TRACEPARENT] == tp and int(h[DEADLINE]) == current_deadline()
        assert int(outgoing_headers(deadline_ms=1)[DEADLINE]) == 1


def test_invalid_traceparent_is_rejected():
    with pytest.raises(ValueError, match="traceparent"), request_context(traceparent="nope"):
        pass


def test_incoming_headers_replace_context_and_ignore_garbage():
    assert context_from_headers({TRACEPARENT: "garbage", DEADLINE: "soon"}) == (None, None)
    tp = new_traceparent()
    with request_context(traceparent=new_traceparent(), timeout=5):
        with incoming_context({TRACEPARENT: tp, DEADLINE: "123"}):
            assert outgoing_headers() == {TRACEPARENT: tp, DEADLINE: "123"}
        with incoming_context(None):
            assert outgoing_headers() is None
