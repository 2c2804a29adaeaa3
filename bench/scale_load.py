"""Load generators and probes for bench/mesh_scale.py: open-loop Poisson streaming completions, closed-loop
streaming clients, submits straight to the scheduler, per-process CPU from /proc, nats-server /varz,
Prometheus counters."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import time
import urllib.request
from dataclasses import dataclass, field

import httpx
import nats
from nats.aio.msg import Msg

from libs.bus import Bus
from libs.loadgen.raw_client import RawClient
from libs.telemetry.context import DEADLINE, now_ms
from proto import Decoder, encode, subjects
from proto import messages as m

_TICK = os.sysconf("SC_CLK_TCK")
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its threads included), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(parts[11]) + int(parts[12])) / _TICK


def varz(monitor_url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{monitor_url}/varz", timeout=5) as r:
        v = json.load(r)
    return {k: int(v[k]) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}


def counter_total(url: str, name: str) -> float:
    """Sum of one counter's samples (every label set) on a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))  # fmt: skip


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def prompt(n: int, salt: int, shared: int = 0) -> list[int]:
    """`shared` leading tokens common to every prompt (a system prompt), then distinct ones: the salt's three
    base-900 digits first, so prompts of different salts (below 900**3) differ from their first page after
    the shared part on (a step of more than 900 requests repeated its prompts before, and so hit the prefix
    caches), then a sequence that cycles; ids 3..902, inside the tiny checkpoint's vocabulary."""
    digits = [salt % 900 + 3, salt // 900 % 900 + 3, salt // 810_000 % 900 + 3]
    rest = [(salt * 131 + 7 * i) % 900 + 3 for i in range(max(0, n - shared - 3))]
    return [7 * i % 900 + 3 for i in range(shared)] + (digits + rest)[: n - shared]


@dataclass
class StreamResult:
    ttft_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    failed: int = 0
    sent: int = 0
    last_done: float = 0.0

    def record(self, first: float | None, tail: bytes) -> None:
        """A finished stream: its TTFT (seconds) and the tokens its usage line counts; failed without them."""
        hit = _USAGE.search(tail)
        if first is None or hit is None:
            self.failed += 1
            return
        self.ok += 1
        self.tokens += int(hit.group(1))
        self.ttft_ms.append(first * 1e3)
        self.last_done = time.perf_counter()


async def stream_one(h: httpx.AsyncClient, url: str, body: dict, res: StreamResult) -> None:
    t0 = time.perf_counter()
    first, tail = None, b""
    try:
        async with h.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.failed += 1
                await r.aread()
                return
            async for chunk in r.aiter_raw():
                if first is None and b'"text"' in chunk:
                    first = time.perf_counter() - t0
                tail = (tail + chunk)[-512:]
    except httpx.HTTPError:
        res.failed += 1
        return
    res.record(first, tail)


def _body(model: str, p: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip


async def poisson(url: str, model: str, rate: float, duration_s: float, prompt_len: int, max_tokens: int,
                  shared: int, seed: int, client: str = "httpx") -> tuple[StreamResult, float]:  # fmt: skip
    """Open loop: arrivals at `rate`/s for duration_s, each a streaming completion; waits for all. Returns
    the result and the wall time from the first arrival to the last completion. `client`: httpx, or raw
    (libs.loadgen's lean client, a pool of keep-alive connections: at a few hundred requests/s httpx's
    ~70 us per chunk makes the load generator the first process to saturate)."""
    rng, res, tasks = random.Random(seed), StreamResult(), []
    raw = RawClient(url, keep=2048) if client == "raw" else None
    h = None if raw else httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=None, max_keepalive_connections=2048)
    )  # fmt: skip

    async def one(body: dict) -> None:
        if h is not None:
            return await stream_one(h, url, body, res)
        assert raw is not None
        try:
            await raw_stream_one(raw, "/v1/completions", body, res)
        except (OSError, ValueError):
            res.failed += 1

    try:
        t0 = time.perf_counter()
        next_at, i = 0.0, 0
        while next_at < duration_s:
            delay = t0 + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule itself
            body = _body(model, prompt(prompt_len, seed * 100_000 + i, shared), max_tokens)
            tasks.append(asyncio.create_task(one(body)))
            i += 1
            res.sent = i
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    finally:
        if raw is not None:
            await raw.aclose()
        if h is not None:
            await h.aclose()
    return res, max(res.last_done, time.perf_counter()) - t0


async def closed_loop(
    url: str, model: str, clients: int, max_tokens: int, prompt_len: int, rounds: int
) -> tuple[StreamResult, float]:
    """`clients` concurrent streaming clients, each sending `rounds` requests back to back."""
    res = StreamResult()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as h:

        async def client(c: int) -> None:
            for r in range(rounds):
                await stream_one(h, url, _body(model, prompt(prompt_len, c * 1000 + r), max_tokens), res)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        return res, time.perf_counter() - t0


class FirstTextAndTail:
    """What closed_loop_raw (and bench.mesh_ttft's raw client) keeps of a stream: when the first text chunk
    came, and the last 512 bytes."""

    def __init__(self, t0: float) -> None:
        self.t0, self.status, self.tail = t0, 0, b""
        self.first: float | None = None

    def on_status(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        if self.first is None and b'"text"' in data:
            self.first = time.perf_counter() - self.t0
        self.tail = (self.tail + data)[-512:]


async def raw_stream_one(client: RawClient, path: str, body: dict, res: StreamResult) -> None:
    """One streaming request over the lean client, kept as RawStream keeps it (first text chunk, usage
    line); connection errors propagate."""
    sink = FirstTextAndTail(time.perf_counter())
    await client.post(path, json.dumps(body).encode(), {}, sink)
    if sink.status != 200:
        res.failed += 1
        return
    res.record(sink.first, sink.tail)


class RawStream:
    """One keep-alive connection of libs.loadgen's lean HTTP/1.1 client (raw_client: httptools, no HTTP
    library) that keeps only what the benchmark needs (time of the first text chunk, the usage line), so
    the load generator costs a fraction of httpx's ~70 us per chunk on this box and competes
    with the gateway for the same two cores. Like wrk or h2load, it does not parse events (`moemesh bench`
    does, with the same client)."""

    def __init__(self, host: str, port: int) -> None:
        self.client = RawClient(f"http://{host}:{port}", keep=1)

    async def post(self, path: str, body: dict, res: StreamResult) -> None:
        await raw_stream_one(self.client, path, body, res)

    async def close(self) -> None:
        await self.client.aclose()


async def closed_loop_raw(
    url: str, model: str, clients: int, max_tokens: int, prompt_len: int, rounds: int
) -> tuple[StreamResult, float]:
    """closed_loop with RawStream clients (one connection each)."""
    res = StreamResult()
    u = httpx.URL(url)
    conns = [RawStream(u.host, u.port or 80) for _ in range(clients)]

    async def client(c: int) -> None:
        for r in range(rounds):
            try:
                await conns[c].post(
                    "/v1/completions", _body(model, prompt(prompt_len, c * 1000 + r), max_tokens), res
                )
            except (OSError, ValueError):
                res.failed += 1
                await conns[c].close()

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in range(clients)))
    finally:
        for c in conns:
            await c.close()
    return res, time.perf_counter() - t0


async def submit_flood(nats_url: str, model: str, in_flight: int, total: int, prompt_len: int) -> dict:
    """Submits straight to the scheduler (no gateway), `in_flight` outstanding, max_tokens=1: each ends
    when its finished delta arrives on the bench's stream subject."""
    bus = await Bus.connect(nats_url, "mesh-scale-flood")
    stream = subjects.stream("scale-flood")
    done: dict[str, asyncio.Future] = {}

    async def on_stream(msg: m.StreamMessage) -> None:
        match msg:
            case m.TokenBatch(deltas=deltas):
                for d in deltas:
                    if (
                        d.finish != m.FinishReason.NONE
                        and (f := done.pop(d.request_id, None)) is not None
                        and not f.done()
                    ):
                        f.set_result(True)
            case m.RequestError(request_id=rid):
                if (f := done.pop(rid, None)) is not None and not f.done():
                    f.set_result(False)

    await bus.subscribe(stream, m.StreamMessage, on_stream)
    await bus.flush()
    ids, sem, outcome = itertools.count(), asyncio.Semaphore(in_flight), {"ok": 0, "failed": 0}
    loop = asyncio.get_running_loop()

    async def one() -> None:
        async with sem:
            rid = f"flood-{next(ids)}"
            fut = done[rid] = loop.create_future()
            s = m.Submit(request_id=rid, model=model, prompt_ids=prompt(prompt_len, hash(rid) % 10_000, prompt_len // 2),
                         sampling=m.Sampling(max_tokens=1, temperature=0, ignore_eos=True), stream_subject=stream)  # fmt: skip
            reply = await bus.request(subjects.SCHED_SUBMIT, s, m.SubmitReply, timeout=30)
            ok = reply.ok and await asyncio.wait_for(fut, 60)
            outcome["ok" if ok else "failed"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)), return_exceptions=True)
    wall = time.perf_counter() - t0
    await bus.close()
    return {**outcome, "wall_s": wall, "in_flight": in_flight, "prompt_len": prompt_len}


@dataclass
class _Flood:
    """State of submit_flood_lean: the next submit to send and how each one ended."""

    payloads: list[bytes]
    ok: int = 0
    failed: int = 0
    sent: int = 0
    open: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)  # why each failed one failed

    def end(self, i: int, ok: bool) -> bool:
        """Submit `i` ended (finished delta, error, refusal); False if it had already ended."""
        if i not in self.open:
            return False
        self.open.discard(i)
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        return True


def flood_payloads(model: str, total: int, prompt_len: int, stream: str) -> list[bytes]:
    """`total` encoded Submits (max_tokens=1, `prompt_len // 2` shared leading tokens, the rest distinct
    per request), built before a flood starts so the load generator's time goes to the bus."""
    sampling = m.Sampling(max_tokens=1, temperature=0, ignore_eos=True)
    out = []
    for i in range(total):
        ids = prompt(prompt_len, i % 10_000, prompt_len // 2)
        s = m.Submit(
            request_id=f"flood-{i}", model=model, prompt_ids=ids, sampling=sampling, stream_subject=stream
        )
        out.append(encode(s))
    return out


async def submit_flood_lean(
    nats_url: str, payloads: list[bytes], stream: str, in_flight: int, timeout_s: float = 120.0
) -> dict:
    """submit_flood without the bus layer's per-request cost in the load generator: Submits encoded
    beforehand (flood_payloads, with `stream` as their stream subject) published on SCHED_SUBMIT with a
    reply subject and a deadline header each (what Bus.request sends, so the scheduler reads what a
    gateway's submit gives it), replies and stream messages handled in plain callbacks, and the next
    submit sent when one ends (no task, future or timer per request). A submit ends ok when its finished
    delta arrives, failed on a refusal or RequestError; any still open after `timeout_s` count as failed."""
    state, total = _Flood(payloads), len(payloads)
    nc = await nats.connect(nats_url, name="mesh-scale-flood", max_reconnect_attempts=0)
    inbox = nc.new_inbox()
    replies, events = Decoder(m.SubmitReply | m.Rejected), Decoder(m.StreamMessage)
    done = asyncio.get_running_loop().create_future()

    async def send_next() -> None:
        while state.sent < total and len(state.open) < in_flight:
            i = state.sent
            state.sent += 1
            state.open.add(i)
            deadline = {DEADLINE: str(now_ms() + 30_000)}  # the old client's Bus.request timeout
            await nc.publish(subjects.SCHED_SUBMIT, state.payloads[i], reply=f"{inbox}.{i}", headers=deadline)

    async def ended(i: int, ok: bool, why: str = "") -> None:
        if state.end(i, ok):
            if not ok:
                state.errors.append(f"submit {i}: {why}")
            if state.ok + state.failed == total and not done.done():
                done.set_result(None)
            await send_next()

    async def on_reply(msg: Msg) -> None:
        r = replies.decode(msg.data)
        if not (isinstance(r, m.SubmitReply) and r.ok):
            await ended(int(msg.subject.rsplit(".", 1)[1]), False, f"refused: {r}")

    async def on_stream(msg: Msg) -> None:
        match events.decode(msg.data):
            case m.TokenBatch(deltas=deltas):
                for d in deltas:
                    if d.finish != m.FinishReason.NONE:
                        await ended(int(d.request_id.rsplit("-", 1)[1]), True)
            case m.RequestError(request_id=rid, code=code, message=message):
                await ended(int(rid.rsplit("-", 1)[1]), False, f"error {code}: {message}")

    await nc.subscribe(f"{inbox}.*", cb=on_reply)
    await nc.subscribe(stream, cb=on_stream)
    await nc.flush()
    t0 = time.perf_counter()
    await send_next()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    wall = time.perf_counter() - t0
    state.failed += len(state.open) + (total - state.sent)
    state.errors += [f"submit {i}: still open after {timeout_s:g} s" for i in sorted(state.open)]
    await nc.close()
    return {"ok": state.ok, "failed": state.failed, "wall_s": wall, "in_flight": in_flight, "client": "lean",
            "errors": state.errors[:20]}  # fmt: skip
