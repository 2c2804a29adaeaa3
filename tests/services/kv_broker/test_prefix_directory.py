"""The kv-broker's prefix index over a real nats-server, fed by real KvEventPublishers (libs.worker) around
radix caches driven through an EngineThread, as in a worker: queries, lost events and resync, a broker
that starts after the workers, departures and silence."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest

from libs.bus import Bus
from libs.engine.pages import PageAllocator
from libs.engine.radix_cache import RadixCache
from libs.prefix import block_hashes
from libs.worker.engine_thread import EngineThread
from libs.worker.kv_events import KvEventPublisher
from proto import messages as m
from proto import subjects
from services.kv_broker.service import BrokerSettings, KvBroker
from tests.service_helpers import start_service, stop_service

PS = 4
TIMEOUT = 5.0


class CacheOnlyEngine:
    """The part of an engine the publisher sees: a radix cache, changed only on the engine thread."""

    def __init__(self) -> None:
        self.alloc = PageAllocator(64)
        self.cache = RadixCache(self.alloc, PS)

    def set_cache_listener(self, listener) -> None:
        self.cache.set_listener(listener)

    def store(self, tokens: list[int]) -> None:
        pages = self.alloc.alloc(-(-len(tokens) // PS))
        self.cache.insert(tokens, pages)
        self.alloc.free(pages)

    def evict_all(self) -> None:
        self.cache.reset()


class LossyBus:
    """A Bus whose KV event publishes can be dropped, as a lost message would be."""

    def __init__(self, bus: Bus) -> None:
        self._bus, self.drop_next = bus, 0

    def __getattr__(self, name: str):
        return getattr(self._bus, name)

    async def publish(self, subject: str, msg, headers=None) -> None:
        if self.drop_next and subject.startswith("mesh.kv_events."):
            self.drop_next -= 1
            return
        await self._bus.publish(subject, msg, headers)


class Worker:
    def __init__(self, bus: Bus, worker_id: str) -> None:
        self.worker_id, self.engine = worker_id, CacheOnlyEngine()
        self.et, self.bus = EngineThread(self.engine), LossyBus(bus)
        self.pub = KvEventPublisher(self.bus, worker_id)  # type: ignore[arg-type]

    async def start(self) -> Worker:
        await self.pub.start(self.et)
        return self

    async def heartbeat(self, interval_ms: int = 250) -> None:
        hb = m.WorkerHeartbeat(
            worker_id=self.worker_id, role=m.Role.PREFILL, model="tiny", running=0, waiting=0, free_pages=64,
            total_pages=64, page_size=PS, max_context=1024, interval_ms=interval_ms, sent_ms=0,
        )  # fmt: skip
        await self.bus.publish(subjects.heartbeat_of(hb), hb)

    async def stop(self) -> None:
        await self.pub.stop()
        self.et.shutdown()


async def until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)  # polls a condition the broker reaches asynchronously


async def start_broker(nats_url: str) -> tuple[KvBroker, asyncio.Task]:
    tag = uuid.uuid4().hex[:10]
    b = KvBroker(
        BrokerSettings(
            nats_url=nats_url, handles_bucket=f"h_{tag}", workers_bucket=f"w_{tag}", drain_timeout_s=2
        )
    )
    return b, await start_service(b, TIMEOUT)


@pytest.fixture
async def broker(nats_server):
    b, task = await start_broker(nats_server)
    yield b
    await stop_service(b, task, TIMEOUT)


@pytest.fixture
async def workers(client):
    made: list[Worker] = []

    async def make(name: str) -> Worker:
        w = await Worker(client, f"{name}-{uuid.uuid4().hex[:6]}").start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


async def query(bus: Bus, tokens: list[int]) -> dict[str, int]:
    q = m.PrefixQuery(page_size=PS, hashes=block_hashes(tokens, PS))
    reply = await bus.request(subjects.BROKER_PREFIX, q, m.PrefixReply, timeout=TIMEOUT)
    return reply.cached_tokens


def index_of(b: KvBroker):
    assert b.prefix is not None
    return b.prefix.index


def metric(b: KvBroker, name: str, **labels: str) -> float:
    return b.registry.get_sample_value(name, labels) or 0.0


async def test_query_answers_cached_tokens_per_worker(broker, client, workers) -> None:
    p0, p1 = await workers("p0"), await workers("p1")
    system = list(range(100, 124))  # 6 pages
    await p0.et.call(p0.engine.store, system + [1, 2, 3, 4, 5])
    await p1.et.call(p1.engine.store, system[:8])
    ix = index_of(broker)
    await until(
        lambda: len(ix.blocks_of(p0.worker_id)) == 7 and len(ix.blocks_of(p1.worker_id)) == 2, "events"
    )
    assert await query(client, system + [9, 9, 9, 9, 9]) == {p0.worker_id: 24, p1.worker_id: 8}
    assert await query(client, [7] * 12) == {}
    await p0.et.call(p0.engine.evict_all)
    await until(lambda: not ix.blocks_of(p0.worker_id), "removals")
    assert await query(client, system) == {p1.worker_id: 8}
    assert metric(broker, "moemesh_kv_broker_prefix_blocks") == 2
    assert metric(broker, "moemesh_kv_broker_prefix_resyncs_total", reason="gap") == 0


async def test_a_lost_event_is_repaired_from_a_snapshot(broker, client, workers) -> None:
    p0 = await workers("p0")
    ix = index_of(broker)
    await p0.et.call(p0.engine.store, list(range(8)))
    await until(lambda: ix.seq_of(p0.worker_id) == (p0.pub.epoch, 1), "first event")
    p0.bus.drop_next = 1
    await p0.et.call(p0.engine.store, list(range(8)) + [50, 51, 52, 53])  # this event is lost
    await p0.et.call(p0.engine.store, [9] * 8)  # the next one shows the gap
    await until(lambda: ix.blocks_of(p0.worker_id) == set(p0.pub.blocks) and not ix.needs_snapshot(p0.worker_id),
                "resync")  # fmt: skip
    assert len(p0.pub.blocks) == 5 and ix.seq_of(p0.worker_id) == (p0.pub.epoch, 3)
    assert metric(broker, "moemesh_kv_broker_prefix_resyncs_total", reason="gap") == 1
    assert await query(client, list(range(8)) + [50, 51, 52, 53]) == {p0.worker_id: 12}


async def test_a_broker_started_after_the_workers_learns_their_caches(nats_server, client, workers) -> None:
    p0 = await workers("p0")
    await p0.et.call(p0.engine.store, list(range(16)))  # published while no broker listens
    b, task = await start_broker(nats_server)
    try:
        await p0.heartbeat()
        await until(lambda: index_of(b).blocks_of(p0.worker_id) == set(block_hashes(list(range(16)), PS)),
                    "snapshot after the first heartbeat")  # fmt: skip
        assert metric(b, "moemesh_kv_broker_prefix_resyncs_total", reason="unknown") == 1
    finally:
        await stop_service(b, task, TIMEOUT)


async def test_departed_and_silent_workers_leave_the_index(broker, client, workers) -> None:
    p0, p1 = await workers("p0"), await workers("p1")
    for w in (p0, p1):
        await w.et.call(w.engine.store, list(range(8)))
        await w.heartbeat(interval_ms=50)
    ix = index_of(broker)
    await until(lambda: {p0.worker_id, p1.worker_id} <= set(ix.workers()), "both indexed")
    await client.publish(subjects.heartbeat("prefill"), m.WorkerGone(worker_id=p0.worker_id, role=m.Role.PREFILL))
    await until(lambda: p0.worker_id not in ix.workers(), "WorkerGone")
    # p1 stays silent: 3 intervals of 50 ms later it is dead
    await until(lambda: p1.worker_id not in ix.workers(), "silence")
    assert await query(client, list(range(8))) == {}
    assert metric(broker, "moemesh_kv_broker_prefix_workers_dropped_total", reason="silent") >= 1


async def test_a_departed_worker_never_indexed_is_forgotten(broker, client) -> None:
    """Heard but never indexed (it answers no snapshot request): its WorkerGone still drops what the
    directory kept of it (heartbeat interval, last resync attempt), or such workers pile up."""
    wid = f"p-{uuid.uuid4().hex[:6]}"
    hb = m.WorkerHeartbeat(
        worker_id=wid, role=m.Role.PREFILL, model="tiny", running=0, waiting=0, free_pages=64, total_pages=64,
        page_size=PS, max_context=1024, interval_ms=250, sent_ms=0,
    )  # fmt: skip
    d = broker.prefix
    assert d is not None
    await client.publish(subjects.heartbeat_of(hb), hb)
    await until(lambda: wid in d.index._intervals and wid in d._last_try, "the heartbeat")
    assert d.index.seq_of(wid) is None
    await client.publish(subjects.heartbeat("prefill"), m.WorkerGone(worker_id=wid, role=m.Role.PREFILL))
    await until(lambda: wid not in d.index._intervals and wid not in d._last_try, "WorkerGone")
    assert metric(broker, "moemesh_kv_broker_prefix_workers_dropped_total", reason="gone") == 0


async def test_bad_query_is_refused(broker, client) -> None:
    from libs.bus import RequestRejected

    with pytest.raises(RequestRejected, match="page_size"):
        await client.request(subjects.BROKER_PREFIX, m.PrefixQuery(page_size=0, hashes=[1]), m.PrefixReply)
