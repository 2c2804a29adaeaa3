"""A benchmark run: warm-up, then the requests on their arrival schedule under a concurrency limit.

`run_load` is the loop (used as-is by the slow-down experiment, which watches the server while it
runs); `run_benchmark` adds the HTTP client, warm-up, progress bar and the summary. A request is
released at its arrival time (schedule.py), then waits for a free slot when `max_concurrency` is set.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from libs.loadgen.client import Endpoint, send
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.schedule import arrival_times
from libs.loadgen.stats import RequestRecord, summarize


@dataclass(frozen=True)
class LoadConfig:
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf  # requests/s of the Poisson arrivals; inf: all at once
    warmup_requests: int = 1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")


def http_client(connections: int) -> httpx.AsyncClient:
    """One pooled client for a run: no read timeout (a slowed server may pause for long), a connect
    timeout so a wrong URL fails fast."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits)


async def run_load(
    client: httpx.AsyncClient,
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    clock: Callable[[], float],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send every request on its schedule; records in request order. Times come from `clock`, whose
    zero is the caller's (arrivals are offsets from the moment this starts)."""
    arrivals = arrival_times(len(requests), load.request_rate, load.seed)
    slots = asyncio.Semaphore(load.max_concurrency or len(requests) or 1)
    t0 = clock()

    async def one(i: int, req: BenchRequest) -> RequestRecord:
        delay = t0 + arrivals[i] - clock()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself, not a wait for a condition
        async with slots:
            rec = await send(client, ep, req, i, clock)
        if on_done is not None:
            on_done(rec)
        return rec

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


async def warm_up(client: httpx.AsyncClient, ep: Endpoint, req: BenchRequest, n: int) -> None:
    """n copies of the first request, at once; a failure stops the benchmark before it starts."""
    if n == 0:
        return
    clock = lambda: time.perf_counter()  # noqa: E731 - timings of warm-ups are not kept
    recs = await asyncio.gather(*(send(client, ep, req, -1, clock) for _ in range(n)))
    failed = [r for r in recs if not r.ok]
    if failed:
        raise ValueError(f"warm-up request failed against {ep.url}: {failed[0].error}")


@dataclass
class BenchRun:
    """One finished run: its settings, summary and per-request records."""

    config: dict[str, Any]
    summary: dict[str, Any]
    records: list[RequestRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "summary": self.summary,
            "requests": [r.to_json() for r in self.records],
        }


async def run_benchmark(
    ep: Endpoint, requests: Sequence[BenchRequest], load: LoadConfig, label: str = ""
) -> BenchRun:
    if not requests:
        raise ValueError("no requests to send")
    connections = max(load.max_concurrency or len(requests), load.warmup_requests, 1)
    async with http_client(connections) as client:
        await warm_up(client, ep, requests[0], load.warmup_requests)
        bar = tqdm(total=len(requests), desc=label or "bench", disable=not load.progress, unit="req")
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        try:
            records = await run_load(client, ep, requests, load, clock, on_done=lambda _: bar.update(1))
        finally:
            bar.close()
        duration = clock()
    config = {
        "base_url": ep.base_url, "backend": ep.backend, "model": ep.model, "num_prompts": len(requests),
        **{k: v for k, v in asdict(load).items() if k != "progress"},
    }  # fmt: skip
    if math.isinf(load.request_rate):
        config["request_rate"] = "inf"  # JSON has no infinity
    return BenchRun(config, summarize(records, duration), records)
