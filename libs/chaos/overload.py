"""Overload for a fixed time: open-loop arrivals at a multiple of the mesh's measured capacity, and the
resident memory of every service process sampled from /proc while it lasts."""

# Capacity is measured first (requests/s finished with a fixed concurrency). During the overload each
# arrival is one short non-streaming completion; the answers are counted by status (200, 429 with
# Retry-After, other), and every admitted request must finish (200, or a clean error) before its
# deadline. Client concurrency is capped, so the load generator itself stays bounded: arrivals due while
# `max_in_flight` requests are open are not sent (`client_capped`), and `sent_rps` is the rate delivered.

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import httpx


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc (0, 0 when it is gone)."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


@dataclass
class MemoryTrace:
    """RSS per service over a run: at the start, the highest sampled, at the end, and the kernel's peak."""

    start_kib: dict[str, int] = field(default_factory=dict)
    peak_kib: dict[str, int] = field(default_factory=dict)
    end_kib: dict[str, int] = field(default_factory=dict)
    hwm_kib: dict[str, int] = field(default_factory=dict)

    def sample(self, pids: Mapping[str, int], first: bool = False) -> None:
        for name, pid in pids.items():
            rss, hwm = rss_kib(pid)
            if first:
                self.start_kib[name] = rss
            self.peak_kib[name] = max(self.peak_kib.get(name, 0), rss)
            self.end_kib[name] = rss
            self.hwm_kib[name] = hwm

    def growth(self) -> dict[str, float]:
        """End RSS over start RSS per service (1.0 = no growth)."""
        return {n: round(self.end_kib[n] / max(1, s), 3) for n, s in self.start_kib.items()}


async def measure_capacity(
    url: str, model: str, prompt: list[int], max_tokens: int, concurrency: int, seconds: float
) -> float:
    """Completed requests per second with `concurrency` clients in a closed loop."""
    done = 0
    stop = time.monotonic() + seconds
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:

        async def client() -> None:
            nonlocal done
            while time.monotonic() < stop:
                r = await h.post("/v1/completions", json=body)
                done += r.status_code == 200

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


@dataclass
class OverloadResult:
    offered_rps: float
    seconds: float
    sent: int
    sent_rps: float  # the load delivered: below offered_rps when the client cap held arrivals back
    statuses: dict[str, int]
    retry_after_on_429: bool
    admitted: int
    admitted_finished: int
    client_capped: int  # arrivals not sent because the client already had max_in_flight open
    max_latency_s: float
    memory: dict[str, dict[str, int] | dict[str, float]]

    def as_dict(self) -> dict:
        return asdict(self)


async def overload(
    url: str, model: str, prompt: list[int], max_tokens: int, rate: float, seconds: float,
    pids: Mapping[str, int], *, max_in_flight: int = 1024, deadline_s: float = 60.0,
) -> OverloadResult:  # fmt: skip
    """`rate` arrivals/s (evenly spaced) for `seconds`, then wait for every answer; RSS sampled every 0.5 s."""
    statuses: Counter[str] = Counter()
    retry_after = True
    latencies: list[float] = []
    mem = MemoryTrace()
    mem.sample(pids, first=True)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    in_flight: set[asyncio.Task] = set()
    capped = sent = 0

    async def one() -> None:
        nonlocal retry_after
        t0 = time.monotonic()
        try:
            r = await h.post("/v1/completions", json=body)
            if r.status_code == 429:  # by who refused: the scheduler's queue or the gateway's own bound
                retry_after = retry_after and "retry-after" in r.headers
                statuses[f"429 {r.json()['error'].get('code')}"] += 1
            else:
                statuses[str(r.status_code)] += 1
        except httpx.HTTPError as e:
            statuses[type(e).__name__] += 1
        latencies.append(time.monotonic() - t0)

    async def sampler() -> None:
        while True:
            await asyncio.sleep(0.5)
            mem.sample(pids)

    async with httpx.AsyncClient(base_url=url, timeout=deadline_s, limits=limits) as h:
        watch = asyncio.create_task(sampler())
        t0 = time.monotonic()
        k = 0
        while (now := time.monotonic() - t0) < seconds:
            due = int(now * rate) + 1
            while k < due:
                k += 1
                if len(in_flight) >= max_in_flight:
                    capped += 1
                    continue
                sent += 1
                task = asyncio.create_task(one())
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.sleep(min(0.01, 1 / rate))
        if in_flight:
            await asyncio.wait(set(in_flight))
        watch.cancel()
        mem.sample(pids)
    admitted = sum(v for s, v in statuses.items() if not s.startswith("429"))
    return OverloadResult(
        offered_rps=rate, seconds=seconds, sent=sent, sent_rps=round(sent / seconds, 2),
        statuses=dict(statuses), retry_after_on_429=retry_after, admitted=admitted, admitted_finished=statuses.get("200", 0), client_capped=capped,
        max_latency_s=round(max(latencies, default=0.0), 3),
        memory={"start_kib": mem.start_kib, "peak_kib": mem.peak_kib, "end_kib": mem.end_kib,
                "hwm_kib": mem.hwm_kib, "end_over_start": mem.growth()},
    )  # fmt: skip


def service_pids(mesh: object) -> dict[str, int]:
    """Every service process of a libs.launch Mesh, its nats-server included (current incarnations)."""
    pids = {name: p.proc.pid for name, p in mesh.sup.procs.items() if p.alive}  # type: ignore[attr-defined]
    return {n: p for n, p in pids.items() if os.path.exists(f"/proc/{p}")}
