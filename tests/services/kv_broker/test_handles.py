import msgspec
import pytest

from proto.messages import HandleRecord, HandleState
from services.kv_broker import handles
from services.kv_broker.handles import HandleError

from .factories import NOW, handle, worker

MAX_LEASE = 60_000


def reserved(lease_in: int = 1000) -> HandleRecord:
    return handles.create(None, handle(NOW + lease_in), worker(), NOW, MAX_LEASE)


def test_create_and_idempotent_retry():
    h = handle(NOW + 1000)
    rec = handles.create(None, h, worker(), NOW, MAX_LEASE)
    assert (rec.state, rec.handle, rec.updated_ms) == (HandleState.RESERVED, h, NOW)
    assert handles.create(rec, h, worker(), NOW + 5, MAX_LEASE) is rec


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: (reserved(), handle(NOW + 1000, handle_id=None), worker()), None),
        (lambda: (None, handle(NOW + 1000), None), "not registered"),
        (lambda: (None, handle(NOW + 1000), worker(session="10.0.0.1:1")), "stale worker incarnation"),
        (lambda: (None, handle(NOW + 1000, pages=[]), worker()), "no pages"),
        (lambda: (None, handle(NOW + 1000, pages=[3, 64]), worker(num_pages=64)), r"page ids \[64\] outside"),
        (lambda: (None, handle(NOW), worker()), "already expired"),
        (lambda: (None, handle(NOW + MAX_LEASE + 1), worker()), "exceeds the broker's limit"),
        (lambda: (None, handle(NOW + 1000, handle_id="a.b"), worker()), "invalid handle_id"),
    ],
)
def test_create_refusals(make, match):
    existing, h, w = make()
    if match is None:  # an existing record with the same id but another handle
        h = handle(NOW + 1000, handle_id=existing.handle.handle_id)
        match = "already exists"
    with pytest.raises(HandleError, match=match):
        handles.create(existing, h, w, NOW, MAX_LEASE)


def test_written_then_consumed():
    rec = reserved()
    w = handles.written(rec, NOW + 10)
    assert (w.state, w.updated_ms) == (HandleState.WRITTEN, NOW + 10)
    assert handles.written(w, NOW + 20) is w  # repeat is a no-op
    c = handles.consumed(w, NOW + 30)
    assert c.state == HandleState.CONSUMED
    assert handles.consumed(c, NOW + 10_000) is c  # consumed is final; the lease no longer applies
    with pytest.raises(HandleError, match="is consumed; cannot mark it written"):
        handles.written(c, NOW + 40)


def test_consumed_straight_from_reserved():
    assert handles.consumed(reserved(), NOW + 1).state == HandleState.CONSUMED


@pytest.mark.parametrize("step", [handles.written, handles.consumed])
def test_past_the_lease_nothing_may_use_it(step):
    rec = reserved(lease_in=1000)
    assert not handles.overdue(rec, NOW + 999)
    assert handles.overdue(rec, NOW + 1000)
    with pytest.raises(HandleError, match="lease expired"):
        step(rec, NOW + 1000)  # before the sweeper marked it
    expired = handles.expire(rec, NOW + 1000)
    assert expired.state == HandleState.EXPIRED
    with pytest.raises(HandleError, match="lease expired"):
        step(expired, NOW + 1001)


def test_expire_only_what_is_overdue():
    with pytest.raises(HandleError, match="not past its lease"):
        handles.expire(reserved(1000), NOW + 999)
    consumed = handles.consumed(reserved(1000), NOW + 1)
    assert not handles.overdue(consumed, NOW + 5000)


def test_plan_sweep():
    live_due = reserved(100)
    live_later = reserved(500)
    written_due = handles.written(reserved(200), NOW + 1)
    consumed_old = handles.consumed(reserved(1000), NOW)  # updated at NOW
    consumed_new = handles.consumed(reserved(1000), NOW + 250)
    expired_old = handles.expire(reserved(10), NOW + 10)
    recs = {
        "a": live_due,
        "b": live_later,
        "c": written_due,
        "d": consumed_old,
        "e": consumed_new,
        "f": expired_old,
    }
    plan = handles.plan_sweep(recs.items(), NOW + 300, retention_ms=100)
    assert sorted(plan.expire) == ["a", "c"]
    assert sorted(plan.forget) == ["d", "f"]
    assert plan.next_due_ms == NOW + 350  # consumed_new leaves retention before live_later's lease
    assert handles.plan_sweep([], NOW, 100).next_due_ms is None


def test_only_live_handles_of_the_same_worker_with_another_session_are_of_an_old_incarnation() -> None:
    old, other = worker("decode-a", "127.0.0.1:1"), worker("decode-b", "127.0.0.1:2")
    new = worker("decode-a", "127.0.0.1:3")
    rec = HandleRecord(handle=handle(10_000, old), state=HandleState.RESERVED, updated_ms=0)
    assert handles.of_old_incarnation(rec, new) and not handles.of_old_incarnation(rec, old)
    assert not handles.of_old_incarnation(
        HandleRecord(handle=handle(10_000, other), state=HandleState.RESERVED, updated_ms=0), new
    )
    done = HandleRecord(handle=rec.handle, state=HandleState.CONSUMED, updated_ms=0)
    assert not handles.of_old_incarnation(done, new)
    assert handles.expire(rec, 0, old_incarnation=True).state == HandleState.EXPIRED  # before its lease
    with pytest.raises(handles.HandleError):
        handles.expire(rec, 0)


def test_per_rank_worker_handles_are_checked_against_the_named_ranks_pool() -> None:
    from tests.libs.kvtransfer.test_ranks import ranked

    w = ranked(2)  # rank 0: 32 pages at :2000, rank 1: 33 pages at :2001
    ok = msgspec.structs.replace(
        handle(NOW + 1000, w, pages=[32]), session_id="127.0.0.1:2001", decode_rank=1
    )
    assert handles.create(None, ok, w, NOW, 60_000).state == HandleState.RESERVED
    for bad, match in (
        (msgspec.structs.replace(ok, decode_rank=0), "registered '127.0.0.1:2000'"),  # rank 1's session
        (
            msgspec.structs.replace(ok, session_id="127.0.0.1:2000", decode_rank=0),
            "outside",
        ),  # page 32 > rank 0's
        (msgspec.structs.replace(ok, decode_rank=-1), "must name its decode_rank"),
        (msgspec.structs.replace(ok, decode_rank=2), "no KV pool of rank 2"),
    ):
        with pytest.raises(handles.HandleError, match=match):
            handles.create(None, bad, w, NOW, 60_000)
    # a restart changes every rank's session: its old handles are of an old incarnation
    rec = HandleRecord(handle=ok, state=HandleState.RESERVED, updated_ms=0)
    assert not handles.of_old_incarnation(rec, w)
    moved = msgspec.structs.replace(
        w, ranks=[msgspec.structs.replace(p, session_id=f"127.0.0.1:{3000 + p.rank}") for p in w.ranks]
    )
    assert handles.of_old_incarnation(rec, moved)
