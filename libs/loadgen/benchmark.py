"""A benchmark run: warm-up, then the requests on their arrival schedule under a concurrency limit."""

# `run_load` is the loop (used as-is by the slow-down experiment, which watches the server while it
# runs); `run_split` is the same over client processes (procs.py); `run_benchmark` adds the streaming
# client, warm-up, progress bar and the summary. A request is released at its arrival time (schedule.py),
# then waits for a free slot when `max_concurrency` is set. Clients (`Clients`): raw_client.RawClient for
# http:// (the least CPU per streamed event), client.HttpxClient for https:// or when asked.

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from libs.loadgen.client import Endpoint, StreamClient, run_clock
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.procs import ClientProcs, deal
from libs.loadgen.schedule import arrival_times
from libs.loadgen.sending import open_client, stream_items
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


CLIENTS = ("raw", "httpx")


@dataclass(frozen=True)
class Clients:
    """How the load is sent: the client kind (None: raw for http://, httpx for https://), how many
    processes share the requests (procs.py), and the event loop of client processes (libs.bus.loop:
    "auto" is uvloop where installed; the CLI runs its own loop on it too)."""

    kind: str | None = None
    procs: int = 1
    event_loop: str = "auto"

    def resolve(self, base_url: str) -> str:
        """The client kind for this server, or a clear error."""
        if self.procs < 1:
            raise ValueError(f"--client-procs must be >= 1, got {self.procs}")
        kind = self.kind or ("raw" if base_url.startswith("http://") else "httpx")
        if kind not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {kind!r}")
        if kind == "raw" and not base_url.startswith("http://"):
            raise ValueError(f"the raw client speaks plain http://; use --client httpx for {base_url}")
        return kind


def http_client(connections: int) -> httpx.AsyncClient:
    """A pooled httpx client for the few non-streaming calls (models, admin); a connect timeout so a
    wrong URL fails fast, no read timeout (a slowed server may pause for long)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits)


async def run_load(
    client: StreamClient,
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    clock: Callable[[], float],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send every request on its schedule; records in request order. Times come from `clock`, whose
    zero is the caller's (arrivals are offsets from the moment this starts)."""
    arrivals = arrival_times(len(requests), load.request_rate, load.seed)
    items = [(i, arrivals[i], r) for i, r in enumerate(requests)]
    return await stream_items(client, ep, items, load.max_concurrency, clock, clock(), on_done)


async def run_split(
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    clients: Clients,
    t0: float | None,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """run_load over `clients.procs` child processes: (records, t0), t0 the clock base of the records
    (now, once the children are ready, when None)."""
    shares = deal(requests, arrival_times(len(requests), load.request_rate, load.seed), load.max_concurrency,
                  clients.procs)  # fmt: skip
    async with ClientProcs(ep, clients.resolve(ep.base_url), clients.event_loop, shares) as children:
        t0 = time.monotonic() if t0 is None else t0
        return await children.run(t0, on_done), t0


async def warm_up(client: StreamClient, ep: Endpoint, req: BenchRequest, n: int) -> None:
    """n copies of the first request, at once; a failure stops the benchmark before it starts."""
    if n == 0:
        return
    clock = run_clock()  # timings of warm-ups are not kept
    recs = await asyncio.gather(*(client.send(ep, req, -1, clock) for _ in range(n)))
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
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    label: str = "",
    clients: Clients = Clients(),
) -> BenchRun:
    if not requests:
        raise ValueError("no requests to send")
    kind = clients.resolve(ep.base_url)
    connections = max(load.max_concurrency or len(requests), load.warmup_requests, 1)
    client = open_client(kind, ep.base_url, connections)
    try:
        await warm_up(client, ep, requests[0], load.warmup_requests)
        bar = tqdm(total=len(requests), desc=label or "bench", disable=not load.progress, unit="req")
        try:
            if clients.procs > 1:
                records, t0 = await run_split(ep, requests, load, clients, None, lambda: bar.update(1))
                clock = run_clock(t0)
            else:
                clock = run_clock()
                records = await run_load(client, ep, requests, load, clock, on_done=lambda _: bar.update(1))
        finally:
            bar.close()
        duration = clock()
    finally:
        await client.aclose()
    config = {
        "base_url": ep.base_url, "backend": ep.backend, "model": ep.model, "num_prompts": len(requests),
        **{k: v for k, v in asdict(load).items() if k != "progress"},
    }  # fmt: skip
    if math.isinf(load.request_rate):
        config["request_rate"] = "inf"  # JSON has no infinity
    return BenchRun(config, summarize(records, duration), records)
