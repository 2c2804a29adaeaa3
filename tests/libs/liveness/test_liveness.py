"""The shared liveness rule and holder index (pure), and the watch against a real nats-server."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.bus import Bus
from libs.liveness import Holders, LivenessTable, LivenessWatch, expires_at
from proto import messages as m
from proto import subjects

WAIT_S = 60.0  # bound on each wait for the watch's callback


async def until_reported(changed: asyncio.Event, watch: LivenessWatch) -> None:
    """Until on_dead ran; past WAIT_S, fail with what the watch knew (its nodes, expiries, clocks)."""
    try:
        async with asyncio.timeout(WAIT_S):
            await changed.wait()
    except TimeoutError:
        t, sc = watch.table, watch.stall_clock
        nodes = {k: t.expiry(k) for k in list(t._nodes)}
        stalls = None if sc is None else (sc.stalls, round(sc.stalled_s, 3))
        raise AssertionError(
            f"no on_dead within {WAIT_S:.0f}s: nodes->expiry {nodes}, clock {watch.clock():.3f}, monotonic "
            f"{time.monotonic():.3f}, stalls {stalls}, bus connected {watch.bus.is_connected}"
        ) from None


def test_dead_after_n_of_its_own_intervals() -> None:
    t = LivenessTable(dead_after_intervals=3.0)
    t.beat("d0", 100, now=10.0)
    t.beat("d1", 1000, now=10.0)
    assert t.expiry("d0") == pytest.approx(10.3) == expires_at(10.0, 100, 3.0)
    assert t.is_alive("d0", 10.3) and not t.is_alive("d0", 10.31)
    assert t.next_expiry() == pytest.approx(10.3)
    assert t.expire(10.31) == ["d0"] and "d0" not in t and t.is_alive("d1", 10.31)
    assert t.gone("d1") and not t.gone("d1") and len(t) == 0


def test_assumed_nodes_get_one_grace_period_and_restart_clock_forgives_our_outage() -> None:
    t = LivenessTable(dead_after_intervals=2.0, default_interval_ms=500)
    assert not t.is_alive("s0", 0.0)  # unknown
    t.assume("s0", now=1.0)
    assert t.is_alive("s0", 2.0) and t.expire(2.01) == ["s0"]
    t.beat("d0", 500, now=0.0)
    t.restart_clock(now=5.0)  # silent during our own outage: not evidence of death
    assert t.expire(5.5) == [] and t.is_alive("d0", 6.0)
    t.assume("d0", now=100.0)  # known: no-op
    assert t.expiry("d0") == pytest.approx(6.0)


def test_table_is_bounded_and_validates() -> None:
    t = LivenessTable(max_nodes=2)
    t.beat("a", 100, 0.0)
    t.beat("b", 100, 0.0)
    t.beat("c", 100, 0.0)
    t.assume("d", 0.0)
    assert len(t) == 2 and "c" not in t
    with pytest.raises(ValueError, match="interval_ms"):
        t.beat("a", 0, 0.0)
    with pytest.raises(ValueError, match="dead_after_intervals"):
        LivenessTable(dead_after_intervals=0)


def test_holders_index_both_ways() -> None:
    h = Holders()
    h.setdefault("r1", "sched-0")
    h.set("r2", "sched-0")
    h.set("r1", "decode-1")  # the decode worker now holds it
    h.setdefault("r1", "sched-0")  # a late scheduler notice does not win
    assert h.holder("r1") == "decode-1" and h.items_of("sched-0") == ["r2"]
    h.drop("r2")
    h.drop("nope")
    assert h.items_of("sched-0") == [] and h.nodes() == ["decode-1"] and len(h) == 1


async def test_watch_reports_silence_and_goodbyes(private_nats_url: str) -> None:
    # Generous bounds on the waits (events, not sleeps): the watch's StallClock stands still while this
    # process is starved, so on a loaded CI machine a grace period can take several wall seconds (one run
    # timed out at 5 s).
    dead: list[list[str]] = []
    changed = asyncio.Event()

    async def on_dead(nodes: list[str]) -> None:
        dead.append(nodes)
        changed.set()

    bus = await Bus.connect(private_nats_url, "watch-test")
    pub = await Bus.connect(private_nats_url, "watch-pub")
    watch = LivenessWatch(bus, on_dead, dead_after_intervals=2.0)
    try:
        await watch.start()
        await bus.flush()
        hb = m.WorkerHeartbeat(
            worker_id="w-silent", role=m.Role.DECODE, model="x", running=0, waiting=0, free_pages=1,
            total_pages=1, page_size=1, max_context=8, interval_ms=50, sent_ms=0,
        )  # fmt: skip
        await pub.publish(subjects.heartbeat_of(hb), hb)
        await pub.publish(
            subjects.SCHED_HEARTBEAT, m.SchedulerHeartbeat(scheduler_id="s0", interval_ms=60_000, sent_ms=0)
        )
        await pub.flush()
        await until_reported(changed, watch)
        assert dead == [["w-silent"]] and watch.table.is_alive("s0", watch.clock())
        changed.clear()
        await pub.publish(subjects.heartbeat("decode"), m.WorkerGone(worker_id="s0", role=m.Role.DECODE))
        await until_reported(changed, watch)
        assert dead[-1] == ["s0"]
        changed.clear()
        watch.watch("never-heard")  # assumed alive for one grace period of the default interval
        assert watch.table.is_alive("never-heard", watch.clock())
        await until_reported(changed, watch)
        assert dead[-1] == ["never-heard"]
    finally:
        await watch.stop()
        await bus.close()
        await pub.close()
