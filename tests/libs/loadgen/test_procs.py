"""Requests dealt over client processes (pure), and two real client processes against the test's HTTP
server: every request's record comes back once, in request order, on the parent's clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.loadgen.benchmark import Clients, LoadConfig, run_split
from libs.loadgen.client import Endpoint
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.procs import deal
from tests.libs.loadgen.test_raw_client import FakeServer


def _reqs(n: int) -> list[BenchRequest]:
    return [BenchRequest([1, i], 2, 5) for i in range(n)]


def test_deal_round_robin_with_the_limit_split() -> None:
    shares = deal(_reqs(7), [0.1 * i for i in range(7)], 5, 3)
    assert [limit for limit, _ in shares] == [2, 2, 1]
    assert [[it.index for it in items] for _, items in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert shares[1][1][0].arrival_s == pytest.approx(0.1) and shares[1][1][0].prompt == [1, 1]
    assert [limit for limit, _ in deal(_reqs(7), [0.0] * 7, 2, 4)] == [1, 1]  # no child without a slot
    assert len(deal(_reqs(2), [0.0] * 2, None, 4)) == 2  # nor without a request
    with pytest.raises(ValueError, match=">= 1"):
        deal(_reqs(2), [0.0] * 2, None, 0)


async def test_two_client_processes_merge_into_one_run_on_the_parents_clock() -> None:
    fake = FakeServer()
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = srv.sockets[0].getsockname()[1]
    ep = Endpoint(f"http://127.0.0.1:{fake.port}", model="m")
    done: list[None] = []
    async with srv:
        t0 = time.monotonic()
        records, base = await run_split(
            ep, _reqs(6), LoadConfig(max_concurrency=4), Clients(procs=2), t0, lambda: done.append(None)
        )
        end = time.monotonic() - t0
    assert base == t0 and len(done) == 6 and fake.connections == 4  # 2 slots in each child
    assert [r.index for r in records] == list(range(6))
    assert all(r.ok and r.chunk_tokens == [1, 2, 1, 2] and r.completion_tokens == 5 for r in records)
    assert all(0 < r.start < r.chunk_times[0] <= r.end < end for r in records)
    assert sorted(b["prompt"][1] for b in fake.bodies) == list(range(6))
