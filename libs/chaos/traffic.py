"""Steady streaming traffic for long fault runs: greedy streams from a prompt mix, sent by N clients back to back
(closed loop) or at a fixed rate (open loop), some cancelled mid-stream; every request becomes a `Record` (start,
first token, end, how it ended), so rates, TTFT percentiles and errors can be read per time window."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from libs.chaos.load import Outcome, stream_completion

# how a request ended: finished with the reference text | finished otherwise | an error a client should
# retry (429/503/504, the connection) | any other error | past the client deadline | cancelled on purpose
STATUSES = ("ok", "wrong", "retryable", "error", "hung", "cancelled")


@dataclass(frozen=True)
class Record:
    prompt: int  # index into the prompt mix (-1: a fresh prompt)
    start: float  # time.monotonic()
    end: float
    ttft: float | None  # seconds to the first token (None: none came)
    status: str  # one of STATUSES
    detail: str = ""  # the error message


def classify(o: Outcome, want: Sequence[int] | None, max_tokens: int) -> str:
    if o.hung:
        return "hung"
    if o.cancelled:
        return "cancelled"
    if o.error is not None:
        return "retryable" if o.retryable else "error"
    right = o.completion_tokens == max_tokens and (want is None or o.token_ids == list(want))
    return "ok" if o.ok and right else "wrong"


def _difference(o: Outcome, want: Sequence[int] | None) -> str:
    first = next((k for k, (a, b) in enumerate(zip(o.token_ids, want or [], strict=False)) if a != b), None)
    return f"{o.request_id}: {o.completion_tokens} tokens, first differing token at {first}"


class Traffic:
    """Traffic against one gateway URL; `want[i]` is prompt i's reference token ids (None: lengths only).
    Every `cancel_every`-th request is cancelled by the client after `cancel_after` chunks (0: none);
    every `fresh_every`-th sends `fresh(n)`, a prompt no cache holds, checked by its length (prompt -1)."""

    def __init__(
        self, url: str, model: str, prompts: Sequence[list[int]], want: Sequence[list[int]] | None,
        max_tokens: int, deadline_s: float, cancel_every: int = 0, cancel_after: int = 2,
        fresh_every: int = 0, fresh: Callable[[int], list[int]] | None = None,
    ) -> None:  # fmt: skip
        self.url, self.model, self.prompts, self.want = url, model, prompts, want
        self.max_tokens, self.deadline_s = max_tokens, deadline_s
        self.cancel_every, self.cancel_after = cancel_every, cancel_after
        self.fresh: Callable[[int], list[int]] | None = fresh
        self.fresh_every = fresh_every if fresh is not None else 0
        self.records: list[Record] = []
        self.in_flight = 0
        self._n = itertools.count()

    async def one(self, client: httpx.AsyncClient) -> Record:
        n = next(self._n)
        i = -1 if self.fresh_every and n % self.fresh_every == 0 else n % len(self.prompts)
        prompt = self.fresh(n) if i < 0 and self.fresh is not None else self.prompts[i]
        cancel = (
            self.cancel_after if self.cancel_every and n % self.cancel_every == self.cancel_every - 1 else 0
        )
        start = time.monotonic()
        self.in_flight += 1
        try:
            o = await stream_completion(
                client, self.model, prompt, self.max_tokens, self.deadline_s, cancel_after=cancel
            )
        finally:
            self.in_flight -= 1
        want = None if self.want is None or i < 0 else self.want[i]
        status = classify(o, want, self.max_tokens)
        detail = o.error or (_difference(o, want) if status == "wrong" else "")
        rec = Record(i, start, time.monotonic(), o.first_token_s, status, detail)
        self.records.append(rec)
        return rec

    def _client(self, connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.deadline_s + 5), limits=limits)

    async def closed_loop(self, clients: int, stop: asyncio.Event) -> None:
        """`clients` requests open at all times until `stop` is set; returns once the last one ended."""

        async def client_loop(c: httpx.AsyncClient) -> None:
            while not stop.is_set():
                await self.one(c)

        async with self._client(clients + 2) as c:
            await asyncio.gather(*(client_loop(c) for _ in range(clients)))

    async def open_loop(self, rate: float, stop: asyncio.Event, max_in_flight: int = 256) -> int:
        """A request every 1/rate seconds until `stop`; an arrival while `max_in_flight` are open is
        skipped (returned: how many were). Returns once every request sent has ended."""
        skipped = 0
        tasks: set[asyncio.Task[Record]] = set()
        async with self._client(max_in_flight + 2) as c:
            t_next = time.monotonic()
            while not stop.is_set():
                if self.in_flight < max_in_flight:
                    t = asyncio.create_task(self.one(c))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                else:
                    skipped += 1
                t_next += 1.0 / rate
                delay = t_next - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):  # the arrival clock, or stop
                        await asyncio.wait_for(stop.wait(), delay)
            if tasks:
                await asyncio.gather(*tasks)
        return skipped

    def ended_between(self, t0: float, t1: float) -> list[Record]:
        return [r for r in self.records if t0 <= r.end < t1]

    def counts(self, records: Sequence[Record] | None = None) -> dict[str, int]:
        recs = self.records if records is None else records
        return {s: sum(r.status == s for r in recs) for s in STATUSES}
