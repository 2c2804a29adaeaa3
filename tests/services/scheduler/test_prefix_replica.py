"""The scheduler's local prefix index (prefix_index=local, the default) against a real nats-server: fed by
the workers' KV events, it places on the holder of a prompt's prefix without asking the kv-broker, and
after a missed event it resyncs from the worker's snapshot."""

from __future__ import annotations

import asyncio

from libs.bus import Bus
from libs.prefix import block_hashes
from proto import messages as m
from proto import subjects
from tests.services.scheduler.test_service import TIMEOUT, _get, start  # noqa: F401 (the fixture)

PROMPT = list(range(1, 101))  # what Harness.submit sends for prompt_len=100
HASHES = block_hashes(PROMPT[:-1], 16)


class BrokerWatch:
    """Counts PrefixQuery messages: with a local index none is sent."""

    def __init__(self) -> None:
        self.queries = 0

    async def on_query(self, q: m.PrefixQuery) -> None:
        self.queries += 1


async def _watch_broker(bus: Bus) -> BrokerWatch:
    watch = BrokerWatch()
    await bus.subscribe(subjects.BROKER_PREFIX, m.PrefixQuery, watch.on_query)
    await bus.flush()
    return watch


async def _event(bus: Bus, worker: str, seq: int, hashes: list[int]) -> None:
    await bus.publish(
        subjects.kv_events(worker), m.BlocksStored(worker_id=worker, epoch="e1", seq=seq, hashes=hashes)
    )


async def _indexed(h, worker: str, n: int) -> None:  # noqa: ANN001
    replica = h.svc.replica
    async with asyncio.timeout(TIMEOUT):
        while len(replica.index.blocks_of(worker)) != n:
            await asyncio.sleep(0.005)  # polls the replica's state; no event to wait on in this process


async def test_kv_events_route_to_the_holder_without_asking_the_broker(start) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0)
    watch = await _watch_broker(h.bus)
    await h.decode("d0")
    p0, p1 = await h.prefill("p0"), await h.prefill("p1")
    await _event(h.bus, p1.worker_id, 1, HASHES[:4])
    await _indexed(h, p1.worker_id, 4)
    assert (await h.submit("r1", prompt_len=100)).ok
    task, _ = await _get(p1.tasks)  # p0 would win on load alone (equal load, lower id)
    assert task.request_id == "r1" and p0.inbox.empty()
    assert watch.queries == 0 and h.metric("moemesh_scheduler_prefix_queries_total", outcome="local") == 1
    assert h.metric("moemesh_scheduler_prefix_index_blocks") == 4


async def test_a_missed_event_resyncs_from_the_workers_snapshot(start) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0)
    await h.decode("d0")
    p1_id = h.wid("p1")
    asked: list[m.KvSnapshotRequest] = []
    state = {"seq": 0, "hashes": []}  # the worker's cache as its snapshot reports it

    async def snapshot(req: m.KvSnapshotRequest) -> m.KvSnapshot:
        asked.append(req)
        return m.KvSnapshot(worker_id=p1_id, epoch="e1", seq=state["seq"], hashes=state["hashes"])

    await h.bus.subscribe(subjects.kv_snapshot(p1_id), m.KvSnapshotRequest, snapshot)
    await h.bus.flush()
    p0, p1 = await h.prefill("p0"), await h.prefill("p1")  # p1 is discovered with an empty snapshot
    async with asyncio.timeout(TIMEOUT):
        while h.svc.replica.index.seq_of(p1_id) is None:
            await asyncio.sleep(0.005)
    await _event(h.bus, p1_id, 1, HASHES[:2])
    await _indexed(h, p1_id, 2)
    state.update(seq=3, hashes=HASHES[:6])
    await _event(h.bus, p1_id, 3, HASHES[4:6])  # seq 2 never arrives: a gap
    await _indexed(h, p1_id, 6)
    assert len(asked) == 2 and h.metric("moemesh_scheduler_prefix_index_resyncs_total", reason="gap") == 1
    assert (await h.submit("r1", prompt_len=100)).ok
    task, _ = await _get(p1.tasks)
    assert task.request_id == "r1" and p0.inbox.empty()
