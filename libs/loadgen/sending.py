"""Sending a run's requests through one client on their arrival schedule: `stream_items` (used by
`moemesh bench` in its own process and by each client process of libs/loadgen/procs.py) and
`open_client`, the client kind a run asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from libs.loadgen.client import Endpoint, HttpxClient, StreamClient
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.raw_client import RawClient
from libs.loadgen.stats import RequestRecord


def open_client(kind: str, base_url: str, connections: int) -> StreamClient:
    if kind == "raw":
        return RawClient(base_url, keep=connections)
    return HttpxClient(connections)


async def stream_items(
    client: StreamClient,
    ep: Endpoint,
    items: Sequence[tuple[int, float, BenchRequest]],
    max_concurrency: int | None,
    clock: Callable[[], float],
    start: float,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send each (index, arrival offset, request) at clock time start + offset, at most max_concurrency
    at once; records in the order of `items`."""
    slots = asyncio.Semaphore(max_concurrency or len(items) or 1)

    async def one(i: int, arrival: float, req: BenchRequest) -> RequestRecord:
        delay = start + arrival - clock()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself, not a wait for a condition
        async with slots:
            rec = await client.send(ep, req, i, clock)
        if on_done is not None:
            on_done(rec)
        return rec

    return list(await asyncio.gather(*(one(*item) for item in items)))
