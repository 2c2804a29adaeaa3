"""The seed's way to measure decode at a full batch: hold decode back, let the batch fill, release."""

# With the gateway's admin endpoints (`POST /admin/slowdown`, `GET /admin/workers`, enabled by
# `MOEMESH_GATEWAY_ENABLE_ADMIN`), every decode worker sleeps before each forward, so requests keep
# joining (their KV arrives from prefill) while few tokens are produced. Once the running batch reaches
# the target (or stops growing: the workers' maximum), the sleep is switched off and the client measures
# decode tokens/s while every request is still running: from the release to the first completion.
# The same requests without slow-down give the comparison.
#
# `release_reason` is the pure policy; `run_phase` does the I/O.

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from libs.loadgen.benchmark import Clients, LoadConfig, http_client, run_load, run_split, warm_up
from libs.loadgen.client import Endpoint, run_clock
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.sending import open_client
from libs.loadgen.stats import RequestRecord, aggregate_rate, decode_rate, summarize


class AdminApi:
    """The moemesh gateway's admin endpoints over HTTP."""

    def __init__(self, client: httpx.AsyncClient, ep: Endpoint) -> None:
        self.client, self.ep = client, ep

    def _check(self, resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code == 404:
            raise ValueError(
                f"{self.ep.base_url} has no /admin endpoints: start the moemesh gateway with "
                "MOEMESH_GATEWAY_ENABLE_ADMIN=1"
            )
        if resp.status_code == 401:
            raise ValueError("the admin endpoints need the server's API key (--api-key)")
        if resp.status_code != 200:
            raise ValueError(
                f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text[:300]}"
            )
        return resp.json()

    async def load(self) -> tuple[int, int]:
        """(requests running on all decode workers, prompts in progress on all prefill workers)."""
        url = self.ep.base_url.rstrip("/") + "/admin/workers"
        workers = self._check(await self.client.get(url, headers=self.ep.headers()))["workers"]
        decode = sum(int(w["running"]) for w in workers if w.get("role") == "decode")
        prefill = sum(int(w["running"]) + int(w["waiting"]) for w in workers if w.get("role") == "prefill")
        return decode, prefill

    async def set_slowdown(self, ms: float) -> None:
        url = self.ep.base_url.rstrip("/") + "/admin/slowdown"
        reply = self._check(
            await self.client.post(url, json={"forward_sleep_ms": ms}, headers=self.ep.headers())
        )
        if reply.get("errors"):
            raise ValueError(f"slow-down not applied on every decode worker: {reply['errors']}")


@dataclass(frozen=True)
class SlowdownConfig:
    slowdown_ms: float
    release_at_batch: int
    poll_s: float = 0.05  # how often the batch is sampled
    stall_s: float = 5.0  # a batch that has not grown for this long is at the workers' maximum
    timeout_s: float = 600.0  # release regardless after this long

    def __post_init__(self) -> None:
        if not self.slowdown_ms > 0:
            raise ValueError(f"slowdown_ms must be > 0, got {self.slowdown_ms}")
        if self.release_at_batch < 1:
            raise ValueError(f"release_at_batch must be >= 1, got {self.release_at_batch}")


def release_reason(
    batch: int, peak: int, since_growth_s: float, elapsed_s: float, prefilling: int, cfg: SlowdownConfig
) -> str | None:
    """Why to release the slow-down now, or None to keep holding. "stalled" needs the batch unchanged for
    stall_s *and* no prompt still in prefill (a long prefill queue can keep the batch flat long before it
    delivers)."""
    if batch >= cfg.release_at_batch:
        return "target"
    if peak > 0 and since_growth_s >= cfg.stall_s and prefilling == 0:
        return "stalled"
    if elapsed_s >= cfg.timeout_s:
        return "timeout"
    return None


@dataclass
class _Watch:
    trace: list[tuple[float, int, int]]  # (time, decode batch, prompts in prefill)
    release_s: float | None = None
    reason: str = ""
    batch_at_release: int = 0


async def _watch(
    admin: AdminApi, load: asyncio.Task, clock: Callable[[], float], cfg: SlowdownConfig | None
) -> _Watch:
    """Sample the decode batch until the load ends; with cfg, release the slow-down when it says so."""
    w = _Watch(trace=[])
    peak, grown_at, started = 0, clock(), clock()
    while not load.done():
        batch, prefilling = await admin.load()
        now = clock()
        w.trace.append((now, batch, prefilling))
        if batch > peak:
            peak, grown_at = batch, now
        if cfg is not None and w.release_s is None:
            why = release_reason(batch, peak, now - grown_at, now - started, prefilling, cfg)
            if why is not None:
                # Stamped before the call: the workers run at full speed from some moment inside it, and a short
                # decode can finish before the reply is back (on a loaded machine, a release stamped after the
                # call can come after every request ended, leaving the full-batch window empty).
                released = clock()
                await admin.set_slowdown(0)
                w.release_s, w.reason, w.batch_at_release = released, why, batch
        await asyncio.wait({load}, timeout=cfg.poll_s if cfg else 0.05)  # sampling period, or the load's end
    return w


FULL_BATCH_SHARE = 0.9


def full_batch_window(records: Sequence[RequestRecord], release_s: float) -> dict[str, Any]:
    """Decode rate from the release while at least FULL_BATCH_SHARE of the requests running at the
    release still run. Not "until the first finish": a request that joined long before the others
    (its prefill came first) made tokens during the hold and may finish right after the release."""
    ends = sorted(r.end for r in records if r.ok and r.end > release_s)
    if not ends:
        return {"tokens_per_s": None, "note": "every request finished before the release"}
    keep = math.ceil(FULL_BATCH_SHARE * len(ends))
    end = ends[len(ends) - keep]  # after this finish, fewer than `keep` requests run
    return {
        "from_s": release_s,
        "to_s": end,
        "batch_from": len(ends),
        "batch_to": keep,
        **decode_rate(records, release_s, end),
    }


def decode_phase(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Tokens/s from the first streamed token to the last, ramp-up and tail included."""
    times = [t for r in records if r.ok for t in r.chunk_times]
    if len(times) < 2:
        return {"tokens_per_s": None}
    lo, hi = min(times), max(times)
    return {"from_s": lo, "to_s": hi, "tokens_per_s": aggregate_rate(records, lo, hi)}


def slowdown_endpoint(ep: Endpoint) -> Endpoint:
    """Exact tokens per chunk (the window counts tokens, not chunks) from the usage on every chunk, not
    from logprobs, which cost the server their computation (and, in an engine that computes them apart from
    sampling, its fast decode path)."""
    return replace(ep, chunk_usage=True, chunk_logprobs=False)


async def run_phase(
    ep: Endpoint, requests: Sequence[BenchRequest], cfg: SlowdownConfig | None, clients: Clients = Clients()
) -> dict[str, Any]:
    """Send every request at once and watch the decode batch; with cfg, under slow-down until release.
    With client processes, this process keeps the admin calls and the release; the children only send."""
    ep = slowdown_endpoint(ep)
    kind = clients.resolve(ep.base_url)
    load_cfg = LoadConfig(max_concurrency=None, request_rate=math.inf, warmup_requests=0, progress=False)
    async with http_client(4) as admin_client:
        admin = AdminApi(admin_client, ep)
        await admin.load()  # fails clearly when admin is off, before anything is sent
        client = open_client(kind, ep.base_url, len(requests))
        load: asyncio.Task | None = None
        try:
            await warm_up(client, ep, requests[0], 1)
            t0 = time.monotonic()
            clock = run_clock(t0)
            if cfg is not None:
                await admin.set_slowdown(cfg.slowdown_ms)
            if clients.procs > 1:
                load = asyncio.create_task(_split_records(ep, requests, load_cfg, clients, t0))
            else:
                load = asyncio.create_task(run_load(client, ep, requests, load_cfg, clock))
            watch = await _watch(admin, load, clock, cfg)
            records = await load
        finally:
            if load is not None:
                load.cancel()  # a no-op once it finished; stops the requests when watching failed
                await asyncio.gather(load, return_exceptions=True)  # children stopped before the release
            if cfg is not None:
                await admin.set_slowdown(0)  # never leave the server slowed, whatever happened
            await client.aclose()
        duration = clock()
    out: dict[str, Any] = {
        "summary": summarize(records, duration),
        "peak_batch": max((b for _, b, _ in watch.trace), default=0),
        "decode_phase": decode_phase(records),
        "batch_trace": watch.trace,
        "records": records,
    }
    if cfg is None:
        return out
    if watch.release_s is None:
        raise ValueError(
            "every request finished before the slow-down was released: raise --random-output-len"
        )
    return out | {
        "release_s": watch.release_s,
        "release_reason": watch.reason,
        "batch_at_release": watch.batch_at_release,
        "finished_before_release": sum(1 for r in records if r.ok and r.end <= watch.release_s),
        "full_batch": full_batch_window(records, watch.release_s),
    }


async def _split_records(
    ep: Endpoint, requests: Sequence[BenchRequest], load: LoadConfig, clients: Clients, t0: float
) -> list[RequestRecord]:
    records, _ = await run_split(ep, requests, load, clients, t0)
    return records


async def slowdown_experiment(
    ep: Endpoint,
    baseline_requests: Sequence[BenchRequest],
    slowed_requests: Sequence[BenchRequest],
    cfg: SlowdownConfig,
    clients: Clients = Clients(),
) -> dict[str, Any]:
    """Baseline (no slow-down) then the slowed run; the ratio compares decode at full batch with the
    baseline's decode phase (first to last token). Give the two runs different prompts of the same
    shape: with the same ones, the second run's prefill would be served from the prefix cache."""
    baseline = await run_phase(ep, baseline_requests, None, clients)
    slowed = await run_phase(ep, slowed_requests, cfg, clients)
    full = slowed["full_batch"]["tokens_per_s"]
    base = baseline["decode_phase"]["tokens_per_s"]
    config = {"base_url": ep.base_url, "model": ep.model, "num_prompts": len(slowed_requests)}
    return {
        "config": config | {"slowdown_ms": cfg.slowdown_ms, "release_at_batch": cfg.release_at_batch},
        "baseline": baseline,
        "slowdown": slowed,
        "full_batch_decode_tokens_per_s": full,
        "baseline_decode_tokens_per_s": base,
        "ratio": (full / base) if full and base else None,
    }


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """The experiment's result with request records as plain dicts."""

    def phase(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "records": [r.to_json() for r in p["records"]]}

    return {**result, "baseline": phase(result["baseline"]), "slowdown": phase(result["slowdown"])}
