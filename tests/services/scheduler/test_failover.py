"""The scheduler's failover additions: avoided workers, decode-local prefill when no prefill worker can
take a request, the placement notice, and the replica's heartbeat (against a real nats-server)."""

from __future__ import annotations

import asyncio

from libs.bus import Bus
from proto import messages as m
from proto import subjects
from services.scheduler.failover import SchedulerBeacon, place, placed_notice, waiting_line
from services.scheduler.policy import PlanKind, PolicyConfig, Refuse, Wait, schedule
from tests.services.scheduler.factories import make_heartbeat, make_request, make_workers

CFG = PolicyConfig(direct_prefill_threshold=8)


def test_avoided_workers_are_not_chosen() -> None:
    t = make_workers(
        make_heartbeat("d0"), make_heartbeat("d1", running=5), make_heartbeat("p0", m.Role.PREFILL),
        make_heartbeat("p1", m.Role.PREFILL, running=3),
    )  # fmt: skip
    plan = place(t.live(0.0), make_request(100), CFG)
    assert (plan.decode, plan.prefill) == ("d0", "p0")
    plan = place(t.live(0.0), make_request(100), CFG, avoid=["d0", "p0"])
    assert (plan.kind, plan.decode, plan.prefill) == (PlanKind.DISAGGREGATED, "d1", "p1")


def test_no_usable_prefill_worker_falls_back_to_decode_local_prefill() -> None:
    t = make_workers(make_heartbeat("d0"), make_heartbeat("p0", m.Role.PREFILL))
    plan = place(t.live(0.0), make_request(100), CFG, avoid=["p0"])
    assert (plan.kind, plan.decode, plan.prefill, plan.num_tokens) == (PlanKind.DIRECT, "d0", None, 100)
    refused = place(make_workers(make_heartbeat("p0", m.Role.PREFILL)).live(0.0), make_request(100), CFG)
    assert isinstance(refused, Refuse) and refused.code == 503 and "decode" in refused.message


def test_the_only_live_decode_worker_is_tried_although_avoided() -> None:
    """A request that lost its decode worker to a stall avoids it; when that worker's heartbeats resumed and
    it is the only live one, the request goes there rather than being refused (no retry with the same avoid
    list could be placed). With another live decode worker the avoided one stays out; prefill workers it
    avoids stay out too (decode-local prefill instead)."""
    t = make_workers(make_heartbeat("d0"), make_heartbeat("p0", m.Role.PREFILL))
    plan = place(t.live(0.0), make_request(100), CFG, avoid=["d0"])
    assert (plan.kind, plan.decode, plan.prefill) == (PlanKind.DISAGGREGATED, "d0", "p0")
    plan = place(t.live(0.0), make_request(100), CFG, avoid=["d0", "p0"])
    assert (plan.kind, plan.decode, plan.prefill) == (PlanKind.DIRECT, "d0", None)
    t = make_workers(
        make_heartbeat("d0"), make_heartbeat("d1", running=5), make_heartbeat("p0", m.Role.PREFILL)
    )
    assert place(t.live(0.0), make_request(100), CFG, avoid=["d0"]).decode == "d1"
    # one for another model, or draining, does not count as serving this request
    other = make_heartbeat("d1", model="other-model")
    t = make_workers(make_heartbeat("d0"), other, make_heartbeat("p0", m.Role.PREFILL))
    assert place(t.live(0.0), make_request(100), CFG, avoid=["d0"]).decode == "d0"
    t = make_workers(
        make_heartbeat("d0"), make_heartbeat("d1", draining=True), make_heartbeat("p0", m.Role.PREFILL)
    )
    assert place(t.live(0.0), make_request(100), CFG, avoid=["d0"]).decode == "d0"


def test_placed_notice_names_the_decode_worker_with_an_empty_delta() -> None:
    n = placed_notice("r1", "decode-1")
    assert n.worker_id == "decode-1" and n.deltas == [m.TokenDelta("r1", [])]


async def test_beacon_beats_at_its_interval_until_stopped(nats_server: str) -> None:
    bus = await Bus.connect(nats_server, "beacon-test")
    got: asyncio.Queue[m.SchedulerHeartbeat] = asyncio.Queue()

    async def on_hb(hb: m.SchedulerHeartbeat) -> None:
        got.put_nowait(hb)

    await bus.subscribe(subjects.SCHED_HEARTBEAT, m.SchedulerHeartbeat, on_hb)
    await bus.flush()
    beacon = SchedulerBeacon(bus, "sched-7", 20, lambda: 4)
    beacon.start()
    try:
        async with asyncio.timeout(5):
            a, b = await got.get(), await got.get()
        assert (a.scheduler_id, a.interval_ms, a.queued) == ("sched-7", 20, 4) and b.sent_ms >= a.sent_ms
    finally:
        await beacon.stop()
        await bus.close()


def test_a_decode_worker_with_a_full_waiting_line_takes_nothing_more() -> None:
    t = make_workers(make_heartbeat("d0", waiting=4), make_heartbeat("d1", waiting=1, running=9))
    short = make_request(4)
    assert place(t.live(0.0), short, CFG, max_waiting=4).decode == "d1"  # d0's line is full
    t.note_placement("d1")
    t.note_placement("d1")
    t.note_placement("d1")  # placements since the last heartbeat count as waiting
    decision = place(t.live(0.0), short, CFG, max_waiting=4)
    assert isinstance(decision, Wait) and "4 requests waiting" in decision.reason
    assert place(t.live(0.0), short, CFG, max_waiting=0).decode == "d0"  # 0: no bound


def test_placements_a_free_batch_slot_takes_are_not_a_line() -> None:
    """Sequential requests finish between heartbeats: with the batch size in the heartbeat, placements up
    to its free slots are not counted as waiting (one decode worker took only max_waiting placements per
    heartbeat interval when every placement since counted, at any load)."""
    t = make_workers(make_heartbeat("d0", running=2, max_running=8))
    short = make_request(4)
    for _ in range(6):  # 2 running + 6 placed: the batch's 8 slots
        t.note_placement("d0")
    d0 = t.get("d0")
    assert d0 is not None and waiting_line(d0) == 0
    assert place(t.live(0.0), short, CFG, max_waiting=4).decode == "d0"
    for _ in range(4):  # 4 beyond the slots may be waiting: the line is full
        t.note_placement("d0")
    assert waiting_line(d0) == 4
    decision = place(t.live(0.0), short, CFG, max_waiting=4)
    assert isinstance(decision, Wait) and "4 requests waiting" in decision.reason


def test_accepted_but_not_started_placements_take_batch_slots() -> None:
    """A decode worker's `pending` (KV on its way from a prefill worker, direct prompts before their step)
    is neither running nor waiting in its heartbeat, yet each takes a slot: without it a scheduler placed
    past the line on a worker whose prefills were slow (every heartbeat showed a free batch)."""
    t = make_workers(
        make_heartbeat("d0", running=2, max_running=4, pending=3),
        make_heartbeat("d1", running=3, max_running=4),
    )  # fmt: skip
    d0, d1 = t.get("d0"), t.get("d1")
    assert d0 is not None and d1 is not None
    assert (waiting_line(d0), waiting_line(d1)) == (1, 0)
    assert (d0.decode_load, d1.decode_load) == (5, 3)
    short = make_request(4)
    assert place(t.live(0.0), short, CFG, max_waiting=1).decode == "d1"  # d0's line of 1 is full
    assert schedule(t.live(0.0), short, CFG).decode == "d1"  # and it is the busier one
    t2 = make_workers(make_heartbeat("d0", waiting=1, running=4, max_running=4, pending=2))
    w = t2.get("d0")
    assert w is not None and waiting_line(w) == 3


def test_with_a_line_at_the_heartbeat_or_no_batch_size_every_placement_since_waits() -> None:
    t = make_workers(make_heartbeat("d0", waiting=1, running=8, max_running=8), make_heartbeat("d1"))
    for w in ("d0", "d1"):
        t.note_placement(w)
        t.note_placement(w)
    d0, d1 = t.get("d0"), t.get("d1")
    assert d0 is not None and d1 is not None
    assert (waiting_line(d0), waiting_line(d1)) == (3, 2)  # d1 predates max_running: 0, every one counts
