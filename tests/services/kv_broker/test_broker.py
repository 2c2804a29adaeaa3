import asyncio
import uuid

import pytest

from libs.bus import Bus, RequestRejected
from proto import messages as m
from proto import subjects
from services.kv_broker.service import BrokerSettings, KvBroker
from tests.service_helpers import start_service, stop_service

from .factories import geometry, handle, register, worker


class FakeClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def settings(nats_url: str, tag: str, **kw) -> BrokerSettings:
    return BrokerSettings(
        nats_url=nats_url, handles_bucket=f"h_{tag}", workers_bucket=f"w_{tag}", drain_timeout_s=2.0, **kw
    )


@pytest.fixture
async def broker(nats_server):
    """A broker on its own buckets, with a fake clock the test moves (sweeps are run by hand)."""
    clock = FakeClock(1_000_000)
    b = KvBroker(
        settings(nats_url=nats_server, tag=uuid.uuid4().hex[:12], max_sweep_interval_s=60.0), clock=clock
    )
    task = await start_service(b)
    yield b, clock
    await stop_service(b, task)


async def ask(bus: Bus, msg) -> m.BrokerReply:
    return await bus.request(subjects.BROKER, msg, m.BrokerReply, timeout=5)


async def inbox(bus: Bus, worker_id: str) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()

    async def on(msg):
        await q.put(msg)

    await bus.subscribe(subjects.decode_inbox(worker_id), m.DecodeInbox, on)
    await bus.flush()
    return q


async def test_worker_registry(broker, client):
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    r = await ask(client, register(w))
    assert r.ok and r.worker == w
    assert (await ask(client, m.LookupWorker(worker_id=w.worker_id))).worker == w
    moved = worker(w.worker_id, session="127.0.0.1:16000")  # a restarted worker re-registers
    await ask(client, register(moved))
    assert (await ask(client, m.LookupWorker(worker_id=w.worker_id))).worker.session_id == "127.0.0.1:16000"
    assert not (await ask(client, m.LookupWorker(worker_id="nobody"))).ok
    bad = m.RegisterWorker(worker_id="x", role=m.Role.DECODE, session_id="s", geometry=geometry(num_pages=0))
    r = await ask(client, bad)
    assert not r.ok and "positive" in r.message


async def test_handle_lifecycle(broker, client):
    b, clock = broker
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    await ask(client, register(w))
    h = handle(clock.now + 5000, w)
    r = await ask(client, m.CreateHandle(handle=h))
    assert r.ok and r.handle.state == m.HandleState.RESERVED
    assert (await ask(client, m.CreateHandle(handle=h))).ok  # a retried create is fine
    clock.now += 10
    r = await ask(client, m.HandleWritten(handle_id=h.handle_id))
    assert r.ok and r.handle.state == m.HandleState.WRITTEN and r.handle.updated_ms == clock.now
    r = await ask(client, m.HandleConsumed(handle_id=h.handle_id))
    assert r.handle.state == m.HandleState.CONSUMED
    r = await ask(client, m.HandleWritten(handle_id=h.handle_id))
    assert not r.ok and "consumed" in r.message and r.handle.state == m.HandleState.CONSUMED
    listed = await ask(client, m.ListHandles(decode_worker=w.worker_id))
    assert [x.handle.handle_id for x in listed.handles] == [h.handle_id]
    assert (await ask(client, m.ReleaseHandle(handle_id=h.handle_id, reason="finished"))).ok
    assert not (await ask(client, m.LookupHandle(handle_id=h.handle_id))).ok
    assert (await ask(client, m.ListHandles(decode_worker=w.worker_id))).handles == []


async def test_a_create_the_mirror_has_not_seen_is_answered_from_the_server(broker, client):
    """CreateHandle writes at once (no read before it): a handle already on the server but not yet in this
    broker's mirror (another replica wrote it a moment ago) is answered as a retry, or refused if it differs;
    twins racing each other get the same record."""
    b, clock = broker
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    await ask(client, register(w))
    h = handle(clock.now + 5000, w)
    first = await ask(client, m.CreateHandle(handle=h))
    assert first.ok
    bucket = b._buckets()[0]
    bucket._mirror.pop(h.handle_id)  # as if the watcher had not delivered it yet
    again = await ask(client, m.CreateHandle(handle=h))
    assert again.ok and again.handle == first.handle
    bucket._mirror.pop(h.handle_id, None)
    other = handle(clock.now + 5000, w, handle_id=h.handle_id)  # the same id, another request
    r = await ask(client, m.CreateHandle(handle=other))
    assert not r.ok and "already exists" in r.message
    bucket._mirror.pop(h.handle_id, None)
    clock.now += 6000  # past the lease: refused as a new handle, still the same retry of the one held
    late = await ask(client, m.CreateHandle(handle=h))
    assert late.ok and late.handle == first.handle
    twin = handle(clock.now + 5000, w)
    replies = await asyncio.gather(*(ask(client, m.CreateHandle(handle=twin)) for _ in range(4)))
    assert all(r.ok for r in replies) and len({r.handle.updated_ms for r in replies}) == 1
    assert (await ask(client, m.LookupHandle(handle_id=twin.handle_id))).handle == replies[0].handle


async def test_refusals_are_replies_not_errors(broker, client):
    b, clock = broker
    r = await ask(client, m.CreateHandle(handle=handle(clock.now + 1000, worker("unregistered"))))
    assert not r.ok and "not registered" in r.message
    assert not (await ask(client, m.HandleConsumed(handle_id="nope"))).ok
    assert (await ask(client, m.ReleaseHandle(handle_id="nope"))).ok  # releasing twice is harmless
    raw = await client.nc.request(subjects.BROKER, b"\x93garbage", timeout=5)
    assert b"Rejected" in raw.data
    with pytest.raises(RequestRejected) as e:
        await client.request(subjects.BROKER, m.Cancel(request_id="r"), m.BrokerReply, timeout=5)
    assert e.value.code == 400
    assert (await ask(client, m.ListHandles())).ok  # still serving


async def test_lease_expiry_notifies_the_owner_and_blocks_use(broker, client):
    b, clock = broker
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    await ask(client, register(w))
    notices = await inbox(client, w.worker_id)
    short, long_ = handle(clock.now + 1000, w), handle(clock.now + 5000, w)
    written = handle(clock.now + 1000, w)
    for h in (short, long_, written):
        assert (await ask(client, m.CreateHandle(handle=h))).ok
    await ask(client, m.HandleWritten(handle_id=written.handle_id))
    clock.now += 999
    assert (await b.sweep()).expire == []
    clock.now += 1
    plan = await b.sweep()
    assert sorted(plan.expire) == sorted([short.handle_id, written.handle_id])
    got = {(await asyncio.wait_for(notices.get(), 5)).handle_id for _ in range(2)}
    assert got == {short.handle_id, written.handle_id}
    r = await ask(client, m.HandleConsumed(handle_id=short.handle_id))
    assert not r.ok and "lease expired" in r.message and r.handle.state == m.HandleState.EXPIRED
    assert (
        await ask(client, m.LookupHandle(handle_id=long_.handle_id))
    ).handle.state == m.HandleState.RESERVED
    assert b.registry.get_sample_value("moemesh_kv_broker_expired_total") == 2
    assert b.registry.get_sample_value("moemesh_kv_broker_handles", {"state": "expired"}) == 2


async def test_use_after_lease_is_refused_and_announced_before_the_sweep(broker, client):
    b, clock = broker
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    await ask(client, register(w))
    notices = await inbox(client, w.worker_id)
    h = handle(clock.now + 100, w)
    await ask(client, m.CreateHandle(handle=h))
    clock.now += 100
    r = await ask(client, m.HandleWritten(handle_id=h.handle_id))
    assert not r.ok and r.handle.state == m.HandleState.EXPIRED
    assert (await asyncio.wait_for(notices.get(), 5)) == m.HandleExpired(
        handle_id=h.handle_id, request_id=h.request_id
    )


async def test_retention_forgets_finished_handles(broker, client):
    b, clock = broker
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    await ask(client, register(w))
    h = handle(clock.now + 1000, w)
    await ask(client, m.CreateHandle(handle=h))
    await ask(client, m.HandleConsumed(handle_id=h.handle_id))
    clock.now += b.settings.retention_ms
    assert (await b.sweep()).forget == [h.handle_id]
    assert not (await ask(client, m.LookupHandle(handle_id=h.handle_id))).ok


async def test_concurrent_transitions_on_one_handle_stay_consistent(broker, client):
    b, clock = broker
    w = worker(f"decode-{uuid.uuid4().hex[:6]}")
    await ask(client, register(w))
    h = handle(clock.now + 5000, w)
    await ask(client, m.CreateHandle(handle=h))
    msgs = [m.HandleWritten(handle_id=h.handle_id), m.HandleConsumed(handle_id=h.handle_id)] * 10
    replies = await asyncio.gather(*(ask(client, x) for x in msgs))
    final = (await ask(client, m.LookupHandle(handle_id=h.handle_id))).handle
    assert final.state == m.HandleState.CONSUMED
    assert all(
        r.ok for r in replies if isinstance(r, m.BrokerReply) and r.handle.state != m.HandleState.CONSUMED
    )


async def test_two_replicas_share_state_and_expire_each_handle_once(nats_server, client):
    tag = uuid.uuid4().hex[:12]
    a = KvBroker(settings(nats_server, tag, max_sweep_interval_s=0.05))
    b = KvBroker(settings(nats_server, tag, max_sweep_interval_s=0.05))
    ta, tb = await start_service(a), await start_service(b)
    try:
        w = worker(f"decode-{uuid.uuid4().hex[:6]}")
        await ask(client, register(w))  # lands on one replica; the other must still accept its handles
        notices = await inbox(client, w.worker_id)
        now = a.clock()
        hs = [handle(now + 300, w) for _ in range(10)]
        for h in hs:
            assert (await ask(client, m.CreateHandle(handle=h))).ok
        got = {(await asyncio.wait_for(notices.get(), 5)).handle_id for _ in hs}
        assert got == {h.handle_id for h in hs}
        expired = sum(x.registry.get_sample_value("moemesh_kv_broker_expired_total") for x in (a, b))
        assert expired == len(hs)  # compare-and-set: one replica won each expiry
    finally:
        await stop_service(a, ta)
        await stop_service(b, tb)


async def test_a_restarted_decode_worker_is_a_new_incarnation_its_old_handles_expire(broker, client):
    b, clock = broker
    old = worker(f"decode-{uuid.uuid4().hex[:6]}", session="127.0.0.1:15000")
    other = worker(f"decode-{uuid.uuid4().hex[:6]}", session="127.0.0.1:15001")
    for w in (old, other):
        await ask(client, register(w))
    notices = await inbox(client, old.worker_id)
    reserved, written, kept = (
        handle(clock.now + 30_000, old),
        handle(clock.now + 30_000, old),
        handle(clock.now + 30_000, other),
    )
    for h in (reserved, written, kept):
        assert (await ask(client, m.CreateHandle(handle=h))).ok
    await ask(client, m.HandleWritten(handle_id=written.handle_id))
    again = await ask(client, register(old))  # the same process registering again changes nothing
    assert (
        again.ok
        and (await ask(client, m.LookupHandle(handle_id=reserved.handle_id))).handle.state
        == m.HandleState.RESERVED
    )

    new = m.WorkerRecord(
        worker_id=old.worker_id, role=old.role, session_id="127.0.0.1:15002", geometry=old.geometry
    )
    assert (
        await ask(client, register(new))
    ).ok  # restarted: a new Mooncake session, long before the leases end
    got = {(await asyncio.wait_for(notices.get(), 5)).handle_id for _ in range(2)}
    assert got == {reserved.handle_id, written.handle_id}
    for h in (reserved, written):
        r = await ask(client, m.HandleConsumed(handle_id=h.handle_id))
        assert not r.ok and r.handle.state == m.HandleState.EXPIRED, r
    assert (
        await ask(client, m.LookupHandle(handle_id=kept.handle_id))
    ).handle.state == m.HandleState.RESERVED
    stale = handle(clock.now + 30_000, old)  # a reservation naming the old session is refused from now on
    assert "stale worker incarnation" in (await ask(client, m.CreateHandle(handle=stale))).message


async def test_drain_ends_a_sweeper_whose_cancel_a_jetstream_write_lost() -> None:
    """The sweeper cancelled while a JetStream write's reply arrives: nats-py's asyncio.wait_for returns the
    reply and the sweeper goes on; the drain must still end it (it hung a SIGTERMed broker under load)."""
    b = KvBroker(BrokerSettings())
    replies: list[asyncio.Future] = []

    async def sweeping() -> None:  # the sweep loop's shape: a write (wait_for on its reply), then the next
        while True:
            reply = asyncio.get_running_loop().create_future()
            replies.append(reply)
            await asyncio.wait_for(reply, 60.0)

    b._sweeper = asyncio.create_task(sweeping())
    await asyncio.sleep(0)
    replies[0].set_result(b"+OK")
    draining = asyncio.create_task(b.on_drain())  # cancels the sweeper in the turn the reply lands
    done, _ = await asyncio.wait({draining}, timeout=3.0)
    assert draining in done and b._sweeper.cancelled()


async def test_the_sweeper_reads_the_buckets_again_after_a_reconnect(broker, monkeypatch) -> None:
    b, _ = broker
    resynced = asyncio.Event()

    async def resync() -> None:
        resynced.set()

    monkeypatch.setattr(b, "resync", resync)
    before = b._reconnects()
    monkeypatch.setattr(b, "_reconnects", lambda: before + 1)  # the connection came back since
    b._wake.set()
    await asyncio.wait_for(resynced.wait(), 5.0)
