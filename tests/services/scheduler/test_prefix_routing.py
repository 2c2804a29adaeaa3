"""The scheduler's prefix-aware placement against a real nats-server: with prefix_index=broker it asks the
kv-broker's index (here a double) with the prompt's block hashes, places on the worker holding the prefix,
sends the prompt with ReserveKv so the decode worker can reuse its cache, and places on load alone when
the index is silent."""

from __future__ import annotations

import pytest

from libs.bus import Bus
from libs.prefix import block_hashes
from proto import messages as m
from proto import subjects
from tests.services.scheduler.test_service import _get, start  # noqa: F401 (the fixture)

PROMPT = list(range(1, 101))  # what Harness.submit sends for prompt_len=100


class FakeIndex:
    """Answers PrefixQuery with fixed cached-token counts (or not at all when `silent`)."""

    def __init__(self, bus: Bus, cached: dict[str, int], silent: bool = False) -> None:
        self.bus, self.cached, self.silent = bus, cached, silent
        self.queries: list[m.PrefixQuery] = []
        self._sub = None

    async def start(self) -> FakeIndex:
        self._sub = await self.bus.subscribe(subjects.BROKER_PREFIX, m.PrefixQuery, self._on_query)
        await self.bus.flush()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_query(self, q: m.PrefixQuery) -> m.PrefixReply | None:
        self.queries.append(q)
        return None if self.silent else m.PrefixReply(cached_tokens=self.cached)


@pytest.fixture
async def index():
    made: list[FakeIndex] = []

    async def make(bus: Bus, cached: dict[str, int], silent: bool = False) -> FakeIndex:
        idx = await FakeIndex(bus, cached, silent).start()
        made.append(idx)
        return idx

    yield make
    for idx in made:
        await idx.stop()


async def test_request_goes_to_the_prefill_worker_holding_its_prefix(start, index) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0, prefix_index="broker")
    d, p0, p1 = await h.decode("d0"), await h.prefill("p0"), await h.prefill("p1")
    idx = await index(h.bus, {p1.worker_id: 64})
    assert (await h.submit("r1", prompt_len=100)).ok
    task, _ = await _get(p1.tasks)  # p0 would win on load alone (equal load, lower id)
    assert task.request_id == "r1" and p0.inbox.empty()
    (q,) = idx.queries
    assert q == m.PrefixQuery(page_size=16, hashes=block_hashes(PROMPT[:-1], 16))
    reserve = await _get(d.reserves)
    assert reserve.prompt_ids == PROMPT  # the decode worker may reuse its own cached prefix
    assert h.metric("moemesh_scheduler_prefix_queries_total", outcome="ok") == 1


async def test_a_silent_index_means_placement_on_load_alone(start, index) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0, prefix_query_timeout_s=0.05, prefix_index="broker")
    await h.decode("d0")
    p0, p1 = await h.prefill("p0"), await h.prefill("p1")
    await index(h.bus, {p1.worker_id: 64}, silent=True)
    assert (await h.submit("r1", prompt_len=100)).ok
    task, _ = await _get(p0.tasks)
    assert task.request_id == "r1" and p1.inbox.empty()
    assert h.metric("moemesh_scheduler_prefix_queries_total", outcome="failed") == 1


async def test_prefix_weight_zero_is_a_prefix_unaware_scheduler(start, index) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=32, prefix_weight=0.0, decode_prefix_reuse=False)
    d = await h.decode("d0")
    p0, p1 = await h.prefill("p0"), await h.prefill("p1")
    idx = await index(h.bus, {p1.worker_id: 64, d.worker_id: 96})
    assert (await h.submit("r1", prompt_len=100)).ok  # 4 uncached tokens on d0, but nobody asked
    task, _ = await _get(p0.tasks)
    assert (await _get(d.reserves)).prompt_ids == []
    assert idx.queries == [] and p1.inbox.empty() and d.directs.empty()


async def test_cached_prefix_on_the_decode_worker_makes_a_long_prompt_direct(start, index) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=32, prefix_index="broker")
    d0, d1 = await h.decode("d0"), await h.decode("d1")
    p = await h.prefill("p0")
    await index(h.bus, {d1.worker_id: 80})
    assert (await h.submit("r1", prompt_len=100)).ok  # 20 uncached tokens on d1
    direct = await _get(d1.directs)
    assert direct.request_id == "r1"
    await h.until(lambda: h.metric("moemesh_scheduler_placements_total", kind="direct") == 1)
    assert d0.directs.empty() and d0.reserves.empty() and p.inbox.empty()


async def test_a_burst_sharing_a_new_prefix_stays_together_before_the_index_knows_it(start) -> None:  # noqa: F811
    # no index answers (no broker): only own placements count; a full hit is worth 2 queued requests
    h = await start(direct_prefill_threshold=0, prefix_weight=2.0)
    await h.decode("d0")
    p0, p1 = await h.prefill("p0"), await h.prefill("p1")
    for rid in ("r1", "r2"):
        assert (await h.submit(rid, prompt_len=100)).ok
    assert [(await _get(p0.tasks))[0].request_id for _ in range(2)] == ["r1", "r2"]  # r2 queues behind r1
    assert (await h.submit("r3", prompt_len=100)).ok  # p0 has 2 in flight: 2 x 0.99 - 2 < 0, spill over
    assert (await _get(p1.tasks))[0].request_id == "r3"


async def test_without_the_pending_window_a_burst_spreads_on_load(start) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0, prefix_pending_ttl_s=0.0)
    await h.decode("d0")
    p0, p1 = await h.prefill("p0"), await h.prefill("p1")
    for rid in ("r1", "r2"):
        assert (await h.submit(rid, prompt_len=100)).ok
    assert (await _get(p0.tasks))[0].request_id == "r1"
    assert (await _get(p1.tasks))[0].request_id == "r2"
