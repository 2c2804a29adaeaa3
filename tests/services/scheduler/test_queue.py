"""The pure admission queue: bound, FIFO, deadlines, retries, cancel."""

from __future__ import annotations

import pytest

from services.scheduler.queue import AdmissionQueue, DuplicateRequest, QueueFull, Retry
from tests.services.scheduler.factories import make_submit


def fill(q: AdmissionQueue, *rids: str, now: float = 0.0, ttl: float = 10.0) -> None:
    for rid in rids:
        q.admit(make_submit(rid), now=now, deadline=now + ttl)


def test_fifo_by_admission() -> None:
    q = AdmissionQueue(max_queue=8, max_retries=1)
    fill(q, "a", "b", "c")
    order = []
    while (e := q.head()) is not None:
        order.append(q.start(e.request_id).request_id)
    assert order == ["a", "b", "c"] and q.depth == 0 and q.placing == 3 and len(q) == 3
    assert q.finish("b") is not None and len(q) == 2


def test_bound_counts_pending_and_placing() -> None:
    q = AdmissionQueue(max_queue=2, max_retries=0)
    fill(q, "a", "b")
    q.start("a")
    with pytest.raises(QueueFull, match="queue full"):
        fill(q, "c")
    q.finish("a")
    fill(q, "c")
    assert [q.head().request_id] == ["b"]


def test_duplicate_request_id_is_refused() -> None:
    q = AdmissionQueue(max_queue=4, max_retries=0)
    fill(q, "a")
    with pytest.raises(DuplicateRequest):
        fill(q, "a")
    q.start("a")
    with pytest.raises(DuplicateRequest):
        fill(q, "a")


def test_failed_placement_keeps_its_place_in_line_until_retries_run_out() -> None:
    q = AdmissionQueue(max_queue=4, max_retries=2)
    fill(q, "a", "b")
    for attempt in (1, 2):
        q.start("a")
        assert q.head().request_id == "b"
        assert q.fail("a", f"refused {attempt}") is Retry.RETRY
        assert q.head().request_id == "a"  # ahead of b again
    q.start("a")
    assert q.fail("a", "refused 3") is Retry.EXHAUSTED
    assert "a" not in q and q.head().request_id == "b"


def test_retries_zero_fails_on_first_refusal() -> None:
    q = AdmissionQueue(max_queue=4, max_retries=0)
    fill(q, "a")
    e = q.start("a")
    assert q.fail("a", "no pages") is Retry.EXHAUSTED and e.attempts == 1 and e.last_error == "no pages"


def test_deadlines_expire_pending_entries_only() -> None:
    q = AdmissionQueue(max_queue=4, max_retries=0)
    q.admit(make_submit("a"), now=0.0, deadline=1.0)
    q.admit(make_submit("b"), now=0.0, deadline=3.0)
    q.admit(make_submit("c"), now=0.0, deadline=0.5)
    q.start("c")  # being placed: bounded by the reservation timeout, not expired here
    assert q.next_deadline() == 1.0
    assert q.expire(0.9) == []
    assert [e.request_id for e in q.expire(1.0)] == ["a"]
    assert q.next_deadline() == 3.0 and q.head().request_id == "b" and "c" in q


def test_cancel_drops_pending_and_marks_placing() -> None:
    q = AdmissionQueue(max_queue=4, max_retries=3)
    fill(q, "a", "b")
    assert q.cancel("b") and "b" not in q
    q.start("a")
    assert not q.is_cancelled("a")
    assert q.cancel("a") and q.is_cancelled("a")
    assert q.fail("a", "timeout") is Retry.GONE and "a" not in q
    assert not q.cancel("zzz")


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="max_queue"):
        AdmissionQueue(max_queue=0, max_retries=0)
    with pytest.raises(ValueError, match="max_retries"):
        AdmissionQueue(max_queue=1, max_retries=-1)
