"""A reservation whose prefill worker dies, or whose lease runs out, ends in a retryable RequestError on
the request's stream (naming the worker to avoid) and counts as cancelled; against a real nats-server."""

from __future__ import annotations

import asyncio

from libs.bus import Bus
from libs.engine.outputs import StepOutput
from proto import messages as m
from proto import subjects
from services.decode_worker.guard import ReservationGuard
from services.decode_worker.streams import Live, delta_of


async def test_dead_prefill_worker_fails_its_reservations_over(nats_server: str) -> None:
    bus = await Bus.connect(nats_server, "guard-test")
    cancelled: set[str] = set()
    errors: asyncio.Queue[m.RequestError] = asyncio.Queue()

    async def on_stream(msg: m.TokenBatch | m.RequestError) -> None:
        if isinstance(msg, m.RequestError):
            errors.put_nowait(msg)

    await bus.subscribe(subjects.stream("g1"), m.StreamMessage, on_stream)
    guard = ReservationGuard(bus, cancelled.add, dead_after_intervals=1.0)
    await guard.start()
    await bus.flush()
    try:
        hb = m.WorkerHeartbeat(
            worker_id="p-live", role=m.Role.PREFILL, model="x", running=0, waiting=0, free_pages=1,
            total_pages=1, page_size=1, max_context=8, interval_ms=60_000, sent_ms=0,
        )  # fmt: skip
        await bus.publish(subjects.heartbeat_of(hb), hb)
        await bus.flush()
        guard.track("r-live", "p-live", subjects.stream("g1"))
        guard.track("r-dead", "p-dead", subjects.stream("g1"))  # never heard: one grace period
        guard.track("r-joined", "p-dead", subjects.stream("g1"))
        guard.untrack("r-joined")  # its KV arrived in time
        guard.track("r-old", "p-dead", "")  # no stream subject (older scheduler): nothing to tell
        async with asyncio.timeout(5):
            err = await errors.get()
        assert (err.request_id, err.code, err.worker_id) == (
            "r-dead",
            503,
            "p-dead",
        ) and "p-dead" in err.message
        assert cancelled == {"r-dead"} and len(guard) == 1
        await guard.lost("r-live", "lease expired")
        async with asyncio.timeout(5):
            err = await errors.get()
        assert (err.request_id, err.code, err.worker_id) == ("r-live", 503, "")
        await guard.lost("r-live", "again")  # already reported: nothing more
        assert errors.empty() and len(guard) == 0 and cancelled == {"r-dead", "r-live"}
    finally:
        await guard.stop()
        await bus.close()


def test_deltas_carry_their_offset_in_the_output() -> None:
    live = Live("s", prompt_tokens=4, completion_tokens=1)  # the first token went out with KvReady
    a = delta_of(StepOutput("r", [7, 8], None, False, None), live)
    b = delta_of(StepOutput("r", [9], None, True, "length"), live)
    assert (a.offset, b.offset, b.completion_tokens) == (1, 3, 4)


def test_lease_backstop_frees_only_reservations_still_held_past_their_deadline() -> None:
    from services.decode_worker.guard import LeaseBackstop

    leases = LeaseBackstop()
    reserved = {"r-lost": "h1", "r-joined": "h2", "r-young": "h3"}
    leases.add("h1", "r-lost", deadline=10.0)  # its CreateHandle never reached the broker
    leases.add("h2", "r-joined", deadline=10.0)
    leases.add("h3", "r-young", deadline=20.0)
    del reserved["r-joined"]  # its KV arrived: the reservation ended the normal way

    def held(rid: str, handle_id: str) -> bool:
        return reserved.get(rid) == handle_id

    assert leases.due(5.0, held) == [] and len(leases) == 2  # the ended one is forgotten
    assert leases.due(10.0, held) == [("h1", "r-lost")] and len(leases) == 1
    assert leases.due(15.0, held) == []  # reported once
    reserved["r-young"] = "h-other"  # the request reserved again under another handle: not this lease
    assert leases.due(25.0, held) == [] and len(leases) == 0
