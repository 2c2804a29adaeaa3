"""A loaded receiver must not declare live peers dead (StallClock), and each process hears only the
heartbeats it needs (per-role subjects): both against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from libs.bus import Bus
from libs.liveness import LivenessWatch, StallClock
from proto import messages as m
from proto import subjects
from services.decode_worker.guard import ReservationGuard


def beat(wid: str, role: m.Role = m.Role.DECODE, interval_ms: int = 50) -> m.WorkerHeartbeat:
    return m.WorkerHeartbeat(
        worker_id=wid, role=role, model="x", running=0, waiting=0, free_pages=1, total_pages=1,
        page_size=1, max_context=8, interval_ms=interval_ms, sent_ms=0,
    )  # fmt: skip


def test_stall_clock_stands_still_while_the_monitor_is_overdue() -> None:
    now = [100.0]
    c = StallClock(tick_s=0.05, slack_s=0.01, base=lambda: now[0])
    assert c() == 100.0  # not started: the base clock
    c.mark(100.0)
    now[0] = 100.05
    assert c() == pytest.approx(100.05)  # on time
    c.mark(100.05)
    now[0] = 102.0  # the loop stalled: the monitor, due at 100.1, has not run
    frozen = c()
    assert frozen == pytest.approx(100.11)  # its due time plus the slack, no further
    c.mark(102.0)  # the monitor runs: the stall is booked, the reading does not jump
    assert c() == pytest.approx(frozen) and c.stalls == 1 and c.stalled_s == pytest.approx(1.89)
    now[0] = 102.04
    assert c() == pytest.approx(frozen + 0.04)  # and runs again


class _Beater:
    """A worker beating every `interval_ms` from its own thread, loop and connection (a separate
    process in the mesh), so the receiver's stalls do not delay the sending."""

    def __init__(self, url: str, wid: str, role: m.Role, interval_ms: int = 50) -> None:
        self.url, self.wid, self.role, self.interval_ms = url, wid, role, interval_ms
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        bus = await Bus.connect(self.url, f"beater-{self.wid}")
        hb = beat(self.wid, self.role, self.interval_ms)
        try:
            while not self.stop.is_set():
                await bus.publish(subjects.heartbeat_of(hb), hb)
                self.sent += 1
                await asyncio.sleep(self.interval_ms / 1000)
        finally:
            await bus.close()

    def __enter__(self) -> _Beater:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def test_a_stalled_receiver_does_not_declare_a_beating_worker_dead(private_nats_url: str) -> None:
    dead: list[str] = []

    async def on_dead(nodes: list[str]) -> None:
        dead.extend(nodes)

    bus = await Bus.connect(private_nats_url, "stalled-receiver")
    watch = LivenessWatch(bus, on_dead, dead_after_intervals=3.0, tick_s=0.02)
    handled: list[float] = []  # when each heartbeat was handled here

    async def on_beat(msg: m.WorkerHeartbeat | m.WorkerGone) -> None:
        await watch.on_worker(msg)
        handled.append(time.monotonic())

    try:
        await watch.start(subscribe=False)
        await bus.subscribe(subjects.heartbeat("decode"), m.Heartbeat, on_beat)
        await bus.flush()
        with _Beater(private_nats_url, "d-busy", m.Role.DECODE):
            await _until(lambda: "d-busy" in watch.table)
            # Our loop is blocked for 12 of the worker's intervals (4x its 150 ms limit) while it keeps
            # beating: its heartbeats wait unread in our socket; that silence is ours, not the worker's.
            time.sleep(0.6)
            unblocked = time.monotonic()
            await _until(lambda: handled[-1] > unblocked + 0.1)  # a beat sent after the stall, handled
            assert dead == [], "a live worker was declared dead over the receiver's own stall"
            assert watch.stall_clock is not None and watch.stall_clock.stalled_s >= 0.4
        # A real death is still seen: the worker stopped beating.
        await _until(lambda: dead == ["d-busy"])
    finally:
        await watch.stop()
        await bus.close()


async def test_a_decode_worker_hears_prefill_heartbeats_only(private_nats_url: str) -> None:
    """Deliveries must not grow with decode workers squared: a decode worker's guard subscribes to the
    prefill role's subject, and no scheduler heartbeats."""
    bus = await Bus.connect(private_nats_url, "decode-guard")
    pub = await Bus.connect(private_nats_url, "workers")
    guard = ReservationGuard(bus, on_lost=lambda rid: None)
    try:
        await guard.start()
        await bus.flush()
        before = bus.nc.stats["in_msgs"]
        for i in range(20):  # its decode peers, and a scheduler replica
            await pub.publish(subjects.heartbeat("decode"), beat(f"d{i}"))
            await pub.publish(
                subjects.SCHED_HEARTBEAT,
                m.SchedulerHeartbeat(scheduler_id=f"s{i}", interval_ms=50, sent_ms=0),
            )
        # the one it needs, with a long interval so that it cannot expire before the check; sent after the
        # others on the same connection (so anything of theirs delivered arrives first), and again until heard
        sent = 0
        async with asyncio.timeout(10):
            while "p0" not in guard.watch.table:
                await pub.publish(
                    subjects.heartbeat("prefill"), beat("p0", m.Role.PREFILL, interval_ms=60_000)
                )
                await pub.flush()
                sent += 1
                with contextlib.suppress(TimeoutError):
                    await _until(lambda n=sent: bus.nc.stats["in_msgs"] - before >= n, timeout=1.0)
        # each delivery was a p0 beat, none of the others
        assert 1 <= bus.nc.stats["in_msgs"] - before <= sent
        assert [n for n in ("d0", "s0") if n in guard.watch.table] == []
    finally:
        await guard.stop()
        await bus.close()
        await pub.close()
