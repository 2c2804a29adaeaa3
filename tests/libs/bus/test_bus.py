import asyncio
import threading
import time
import uuid

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from libs.bus import (
    Bus,
    DeadlineExceeded,
    NoResponders,
    PayloadTooLarge,
    RequestRejected,
    RequestTimeout,
    current_deadline,
    current_traceparent,
    new_traceparent,
    now_ms,
    request_context,
    time_left,
)
from proto import Decoder
from proto.messages import Rejected


class Ping(msgspec.Struct, frozen=True, tag=True):
    n: int


class Blob(msgspec.Struct, frozen=True, tag=True):
    data: bytes


class Pong(msgspec.Struct, frozen=True, tag=True):
    n: int


Inbox = Ping | Blob


def subj() -> str:
    return f"test.bus.{uuid.uuid4().hex}"


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(nats_server, "test-bus", registry=CollectorRegistry())
    yield b
    await b.close()


async def test_publish_subscribe_union_in_order(bus):
    s, got, done = subj(), [], asyncio.Event()

    async def handler(msg):
        match msg:
            case Ping(n=n):
                got.append(n)
            case Blob(data=d):
                got.append(d)
        if len(got) == 4:
            done.set()

    await bus.subscribe(s, Inbox, handler)
    for m in (Ping(1), Blob(b"x"), Ping(2), Ping(3)):
        await bus.publish(s, m)
    await asyncio.wait_for(done.wait(), 5)
    assert got == [1, b"x", 2, 3]


async def test_publish_now_has_handed_the_message_to_the_socket(bus):
    """After publish_now nothing waits in the client's buffer (the caller may block the process next, as
    the prefill worker does with a KV write); a plain publish leaves it to the writer task's next turn.
    (nats-py's pending buffer is read directly: it is where the message would wait.)"""
    s = subj()
    await bus.publish(s, Ping(1))
    assert bus.nc._pending_data_size > 0
    await bus.flush()
    await bus.publish_now(s, Ping(2))
    assert bus.nc._pending_data_size == 0


async def test_a_message_written_now_reaches_a_subscriber_while_the_publisher_blocks(bus, nats_server):
    """publish_now, and publish + write_pending, leave on the socket before the publisher's loop runs again:
    a subscriber on another thread gets each while this loop is blocked (as a KV write blocks it)."""
    import nats

    s, ready = subj(), threading.Event()
    arrived = {1: threading.Event(), 2: threading.Event()}

    def listen() -> None:
        async def run() -> None:
            nc, both = await nats.connect(nats_server), asyncio.Event()

            async def on(msg) -> None:
                arrived[msgspec.msgpack.decode(msg.data, type=Ping).n].set()
                if all(e.is_set() for e in arrived.values()):
                    both.set()

            await nc.subscribe(s, cb=on)
            await nc.flush()
            ready.set()
            await asyncio.wait_for(both.wait(), 30)
            await nc.close()

        asyncio.run(run())

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 10)
    await bus.publish_now(s, Ping(1))
    assert arrived[1].wait(10)  # blocks this loop: only the socket could have carried it
    await bus.publish(s, Ping(2))
    bus.write_pending()
    assert arrived[2].wait(10)
    await asyncio.to_thread(thread.join, 10)


async def test_write_pending_leaves_a_backed_up_socket_to_the_clients_writer(bus, monkeypatch):
    """Past WRITE_NOW_MAX_BUFFERED bytes in the socket's buffer the queue stays for nats-py's writer task,
    which waits for the drain (the backpressure a direct write would skip)."""
    from libs.bus import bus as bus_module

    sock = bus.nc._transport._io_writer.transport
    s = subj()
    await bus.flush()
    monkeypatch.setattr(sock, "get_write_buffer_size", lambda: bus_module.WRITE_NOW_MAX_BUFFERED)
    await bus.publish(s, Ping(1))
    bus.write_pending()
    assert bus.nc._pending_data_size > 0
    monkeypatch.setattr(sock, "get_write_buffer_size", lambda: 0)
    bus.write_pending()
    assert bus.nc._pending_data_size == 0


async def test_write_pending_on_a_socket_closed_under_it_keeps_the_queue(bus, monkeypatch):
    """The server went away and nats-py has not noticed yet: write_pending neither raises (it once ended the
    decode worker's step loop) nor drops the queue, which the client's reconnect sends."""
    sock = bus.nc._transport._io_writer.transport
    await bus.flush()
    await bus.publish(subj(), Ping(1))

    def closed(*_a):
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    monkeypatch.setattr(bus.nc._transport, "writelines", closed)
    bus.write_pending()
    assert bus.nc._pending_data_size > 0
    monkeypatch.setattr(sock, "is_closing", lambda: True)
    bus.write_pending()
    assert bus.nc._pending_data_size > 0
    monkeypatch.undo()  # the fixture's close writes through the real socket


async def test_request_reply_typed(bus):
    s = subj()

    async def handler(msg: Ping) -> Pong:
        return Pong(msg.n * 2)

    await bus.subscribe(s, Ping, handler)
    assert await bus.request(s, Ping(21), Pong, timeout=5) == Pong(42)


async def test_garbage_and_failing_handler_are_answered_and_service_keeps_serving(bus):
    s = subj()

    async def handler(msg: Ping) -> Pong:
        if msg.n < 0:
            raise RuntimeError("negative ping")
        if msg.n == 429:
            raise RequestRejected(429, "slow down")
        return Pong(msg.n)

    await bus.subscribe(s, Ping, handler)
    raw = await bus.nc.request(s, b"\xc1garbage", timeout=5)
    rej = Decoder(Rejected).decode(raw.data)
    assert rej.code == 400 and "cannot decode" in rej.message
    with pytest.raises(RequestRejected) as e:
        await bus.request(s, Blob(b"wrong type"), Pong, timeout=5)
    assert e.value.code == 400
    with pytest.raises(RequestRejected) as e:
        await bus.request(s, Ping(-1), Pong, timeout=5)
    assert e.value.code == 500 and "negative ping" in e.value.message
    with pytest.raises(RequestRejected) as e:
        await bus.request(s, Ping(429), Pong, timeout=5)
    assert (e.value.code, e.value.message) == (429, "slow down")
    assert await bus.request(s, Ping(7), Pong, timeout=5) == Pong(7)
    counts = {
        o: bus.registry.get_sample_value("moemesh_bus_messages_total", {"subscription": s, "outcome": o})
        for o in ("undecodable", "error", "rejected", "ok")
    }
    assert counts == {"undecodable": 2, "error": 1, "rejected": 1, "ok": 1}


async def test_trace_and_deadline_propagate_across_hops(bus):
    a, b = subj(), subj()
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    async def hop_a(msg: Ping) -> None:
        await bus.publish(b, Ping(msg.n + 1))

    async def hop_b(msg: Ping) -> None:
        seen.set_result((msg.n, current_traceparent(), current_deadline(), time_left()))

    await bus.subscribe(a, Ping, hop_a)
    await bus.subscribe(b, Ping, hop_b)
    tp = new_traceparent()
    with request_context(traceparent=tp, timeout=30):
        deadline = current_deadline()
        await bus.publish(a, Ping(1))
    n, got_tp, got_deadline, left = await asyncio.wait_for(seen, 5)
    assert (n, got_tp, got_deadline) == (2, tp, deadline)
    assert 0 < left <= 30
    assert current_traceparent() is None  # nothing leaked into the caller's context


async def test_request_wait_is_bounded_by_the_deadline_in_force(bus):
    s, release, seen_deadline = subj(), asyncio.Event(), []

    async def never_in_time(msg: Ping) -> Pong:
        seen_deadline.append(current_deadline())
        await release.wait()
        return Pong(0)

    await bus.subscribe(s, Ping, never_in_time, concurrent=True)
    t0, sent_ms = time.monotonic(), now_ms()
    with request_context(timeout=0.2), pytest.raises(RequestTimeout):
        await bus.request(s, Ping(1), Pong, timeout=30)
    assert time.monotonic() - t0 < 2.0
    assert sent_ms + 150 <= seen_deadline[0] <= sent_ms + 250  # the receiver knows when the caller gives up
    release.set()


async def test_expired_deadline_and_oversized_message_send_nothing(bus):
    s, got, first = subj(), [], asyncio.Event()

    async def handler(msg):
        got.append(msg)
        first.set()

    await bus.subscribe(s, Inbox, handler)
    with request_context(deadline_ms=now_ms() - 1), pytest.raises(DeadlineExceeded):
        await bus.request(s, Ping(1), Pong)
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        await bus.publish(s, Blob(b"x" * (bus.max_payload + 1)))
    with pytest.raises(PayloadTooLarge):
        await bus.request(s, Blob(b"x" * bus.max_payload), Pong)
    await bus.publish(s, Ping(99))  # messages on one connection arrive in order: this must be first
    await asyncio.wait_for(first.wait(), 5)
    assert got[0] == Ping(99)


async def test_no_responders(bus):
    with pytest.raises(NoResponders, match="no subscriber"):
        await bus.request(subj(), Ping(1), Pong, timeout=5)


async def test_concurrent_handlers_overlap_and_drain_waits_for_them(bus):
    s, release, started = subj(), asyncio.Event(), []
    all_started = asyncio.Event()

    async def slow(msg: Ping) -> Pong:
        started.append(msg.n)
        if len(started) == 5:
            all_started.set()
        await release.wait()
        return Pong(msg.n)

    await bus.subscribe(s, Ping, slow, concurrent=True)
    requests = [asyncio.create_task(bus.request(s, Ping(i), Pong, timeout=10)) for i in range(5)]
    await asyncio.wait_for(all_started.wait(), 5)  # only possible if all five run at once
    assert bus.in_flight == 5
    stopper = asyncio.create_task(bus.stop_subscriptions(timeout=10))
    await asyncio.sleep(0)  # let the drain start while handlers are still blocked
    assert not stopper.done()
    release.set()
    assert await asyncio.wait_for(stopper, 10) is True
    assert sorted(r.n for r in await asyncio.gather(*requests)) == list(range(5))
    with pytest.raises(NoResponders):
        await bus.request(s, Ping(1), Pong, timeout=5)


async def test_drain_deadline_cancels_stuck_handlers(bus):
    s, entered = subj(), asyncio.Event()

    async def stuck(msg: Ping) -> None:
        entered.set()
        await asyncio.Event().wait()

    await bus.subscribe(s, Ping, stuck, concurrent=True)
    await bus.publish(s, Ping(1))
    await asyncio.wait_for(entered.wait(), 5)
    assert await bus.stop_subscriptions(timeout=0.1) is False
    assert bus.in_flight == 0


async def test_newer_schema_version_is_a_logged_refusal(bus, caplog):
    """A service one schema version behind neither handles nor silently drops what it cannot read."""
    from proto import messages as m

    s, handled = subj(), []

    async def handler(msg: m.Cancel) -> Pong:
        handled.append(msg)
        return Pong(0)

    await bus.subscribe(s, m.Cancel, handler)
    with caplog.at_level("ERROR", logger="moemesh.bus"), pytest.raises(RequestRejected) as e:
        await bus.request(s, m.Cancel(request_id="r", v=m.SCHEMA_VERSION + 1), Pong, timeout=5)
    assert e.value.code == 503 and f"schema version {m.SCHEMA_VERSION + 1}" in e.value.message
    assert handled == []
    assert any("newer service" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    count = bus.registry.get_sample_value(
        "moemesh_bus_messages_total", {"subscription": s, "outcome": "schema_version"}
    )
    assert count == 1
    assert await bus.request(s, m.Cancel(request_id="r"), Pong, timeout=5) == Pong(0)  # this version: served


async def _outcome(call):
    """A request's outcome as comparable data: the reply, or the error's type, code and message."""
    try:
        return ("reply", await call)
    except RequestRejected as e:
        return ("rejected", e.code, e.message)
    except Exception as e:
        return (type(e).__name__,)


async def test_request_local_gives_what_the_bus_gives(bus):
    """The same handler asked over NATS and in process: equal replies, refusals, handler errors, decode
    refusals and timeouts, under the caller's trace context and deadline; counted under the subject."""
    s, seen, release = subj(), [], asyncio.Event()

    async def handler(msg: Ping) -> Pong | None:
        seen.append((current_traceparent(), current_deadline()))
        if msg.n < 0:
            raise RuntimeError("negative ping")
        if msg.n == 429:
            raise RequestRejected(429, "slow down")
        if msg.n == 1000:
            await release.wait()
        return Pong(msg.n * 2)

    await bus.subscribe(s, Ping, handler, concurrent=True)
    cases = [
        (Ping(21), Pong),
        (Ping(-1), Pong),
        (Ping(429), Pong),
        (Blob(b"wrong type"), Pong),
        (Ping(3), Ping),
    ]
    for msg, reply_type in cases:
        over_bus = await _outcome(bus.request(s, msg, reply_type, timeout=5))
        local = await _outcome(bus.request_local(s, Ping, handler, msg, reply_type, timeout=5))
        assert local == over_bus, msg
    assert [await _outcome(bus.request_local(s, Ping, handler, m, Pong)) for m in (Ping(21), Ping(-1))] == [
        ("reply", Pong(42)),
        ("rejected", 500, "RuntimeError: negative ping"),
    ]
    wrong_reply = await _outcome(bus.request_local(s, Ping, handler, Ping(3), Ping))
    assert wrong_reply[0] == "BusError"  # a Pong is no Ping

    tp, seen[:] = new_traceparent(), []
    with request_context(traceparent=tp, timeout=30):
        deadline = current_deadline()
        assert await bus.request_local(s, Ping, handler, Ping(1), Pong, timeout=2) == Pong(2)
    assert seen[0][0] == tp and now_ms() + 1000 < seen[0][1] <= now_ms() + 2000 < deadline
    with request_context(deadline_ms=now_ms() - 1), pytest.raises(DeadlineExceeded):
        await bus.request_local(s, Ping, handler, Ping(1), Pong)
    with pytest.raises(PayloadTooLarge):
        await bus.request_local(s, Ping, handler, Blob(b"x" * bus.max_payload), Pong)

    with pytest.raises(RequestTimeout):  # the caller stops waiting; the handler runs on, as over the bus
        await bus.request_local(s, Ping, handler, Ping(1000), Pong, timeout=0.1)
    assert bus.in_flight == 1
    release.set()
    assert await bus.stop_subscriptions(5) and bus.in_flight == 0  # the drain waited for it to finish
    counts = {
        o: bus.registry.get_sample_value("moemesh_bus_messages_total", {"subscription": s, "outcome": o})
        for o in ("undecodable", "error", "rejected", "ok")
    }
    assert counts == {"undecodable": 2, "error": 3, "rejected": 2, "ok": 8}
