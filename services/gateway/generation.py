"""One HTTP request in flight on the mesh: its n (x prompts) choices, their queue and its deadline."""

# `start()` registers every choice and submits them (n separate mesh requests); if any is refused the
# others are cancelled and the refusal is raised. `steps()` yields (choice, Step) as deltas arrive,
# until every choice is done, raising ApiError on a mesh error or when the deadline passes. `close()`
# must run whichever way the request ends (the HTTP layer calls it in `finally`): it cancels the
# choices still running and removes every entry from the mesh client's table.

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

from libs.tokenizer import Tokenizer
from proto.messages import RequestError, Submit, TokenDelta
from services.gateway.convert import Plan
from services.gateway.errors import ApiError, mesh_error
from services.gateway.formatting import Choice, Usage
from services.gateway.mesh_client import MeshClient, StreamItem
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import ChoiceRun, TokenGap
from services.gateway.output import ChoiceOutput, Step, TokenText

log = logging.getLogger("moemesh.gateway")


class Inbox:
    """The deltas of one generation's choices, in arrival order: what `MeshClient._route` puts and
    `Generation.steps` takes; `expire()` wakes the reader for the deadline, so no timer is armed per token."""
    # Lighter than asyncio.Queue on the per-token path: one deque append, and one future only when the reader waits.

    __slots__ = ("_items", "_waiter", "expired")

    def __init__(self) -> None:
        self._items: deque[tuple[int, StreamItem]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.expired = False

    def put_nowait(self, item: tuple[int, StreamItem]) -> None:
        self._items.append(item)
        if (w := self._waiter) is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> tuple[int, StreamItem]:
        return self._items.popleft()

    def expire(self) -> None:
        self.expired = True
        if (w := self._waiter) is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Until an item is in, or the inbox expired."""
        while not self._items and not self.expired:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class Generation:
    def __init__(
        self,
        mesh: MeshClient,
        plan: Plan,
        tok: Tokenizer,
        tokens: TokenText,
        model: str,
        metrics: GatewayMetrics,
        *,
        arrival: float,
        deadline: float,
        id_prefix: str,
        max_migrations: int = 0,
    ) -> None:
        self.mesh, self.plan, self.model, self.metrics = mesh, plan, model, metrics
        self.arrival, self.deadline = arrival, deadline  # time.monotonic() values
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue = Inbox()
        self.outputs = [
            ChoiceOutput.create(
                c.index, tok, tokens, plan.prompts[c.prompt_index], plan.stop, plan.logprobs,
                plan.tokens_as_ids, c.sampling.min_tokens,
            )  # fmt: skip
            for c in plan.choices
        ]
        self.runs = [
            ChoiceRun(f"{self.id}-{c.index}", plan.prompts[c.prompt_index], c.sampling, max_migrations)
            for c in plan.choices
        ]
        self.submit_timeout = 5.0
        self.migration_wait = 0.0  # a migration's refused re-submit is tried again this long (set by start)
        self._last_token_at: list[float | None] = [None] * len(plan.choices)
        self._first_token = False
        self._closed = False

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def request_ids(self) -> list[str]:
        """The current mesh request id of each choice (a migrated choice has a new one)."""
        return [r.rid for r in self.runs]

    async def start(self, submit_timeout: float, migration_wait: float) -> None:
        self.submit_timeout, self.migration_wait = submit_timeout, migration_wait
        for k, rid in enumerate(self.request_ids):
            self.mesh.open(rid, self.queue, k)
        subs = [
            Submit(
                request_id=rid,
                model=self.model,
                prompt_ids=self.plan.prompts[c.prompt_index],
                sampling=c.sampling,
                stream_subject=self.mesh.stream_subject,
                arrival_ms=time.time_ns() // 1_000_000,
            )
            for rid, c in zip(self.request_ids, self.plan.choices, strict=True)
        ]
        timeout = max(0.001, min(submit_timeout, self.time_left()))
        if len(subs) == 1:  # the common case: no task per submit (one turn of the loop less before it leaves)
            try:
                await self.mesh.submit(subs[0], timeout)
                errors: list[BaseException] = []
            except Exception as e:
                errors = [e]
        else:
            results = await asyncio.gather(*(self.mesh.submit(s, timeout) for s in subs), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close("another choice of the request was refused")
            raise errors[0]
        self.metrics.prompt_tokens.inc(sum(len(p) for p in self.plan.prompts))

    async def steps(self) -> AsyncIterator[tuple[ChoiceOutput, Step]]:
        """(choice, what it gained) per delta, until all choices are done; ApiError on failure."""
        remaining = sum(not o.done for o in self.outputs)
        inbox = self.queue
        timer = asyncio.get_running_loop().call_later(max(0.0, self.time_left()), inbox.expire)
        try:
            while remaining:
                if inbox.empty():
                    await inbox.wait()
                if inbox.expired or self.time_left() <= 0:
                    self.close("deadline")
                    raise ApiError(504, "the request did not finish before its deadline", code="timeout")
                k, item = inbox.get_nowait()
                out = self.outputs[k]
                if out.done or item.request_id != self.runs[k].rid:  # ended, or from an attempt left behind
                    continue
                step = await self._apply(k, item)
                if step is not None:
                    remaining -= step.done
                    yield out, step
        finally:
            timer.cancel()

    async def _apply(self, k: int, item: StreamItem) -> Step | None:
        """One item for choice k: a recovery (None), nothing new (None), or the step the delta made."""
        run = self.runs[k]
        if isinstance(item, RequestError):
            await self._recover(k, item.code, item.message, item.worker_id)
            return None
        try:
            delta: TokenDelta | None = run.accept(item)
        except TokenGap as e:
            await self._recover(k, 503, f"tokens were lost on the bus ({e})", "")
            return None
        if delta is None:
            return None
        self._observe(k, len(delta.token_ids))
        step = self.outputs[k].feed(delta)
        if step.done:
            self.mesh.close(self.request_ids[k], "stop string" if step.cancel else None)
        return step

    async def _recover(self, k: int, code: int, message: str, lost: str) -> None:
        """Migrate choice k after a failure (see migration.py), or end the request with the error."""
        run = self.runs[k]
        if not run.can_migrate(code) or run.remaining < 1:
            self.close("another choice failed")
            raise mesh_error(code, message)
        self.mesh.close(run.rid, f"migrating: {message}")
        sub = run.next_submit(self.model, self.mesh.stream_subject, time.time_ns() // 1_000_000, lost)
        log.info("%s: %s; migrating (%d/%d) with %d tokens streamed",
                 self.id, message, run.migrations, run.max_migrations, len(run.tokens))  # fmt: skip
        self.metrics.migrations.inc()
        give_up = time.monotonic() + max(self.submit_timeout, self.migration_wait)
        pause = 0.2
        while True:
            self.mesh.open(sub.request_id, self.queue, k)
            try:
                await self.mesh.submit(sub, max(0.001, min(self.submit_timeout, self.time_left())))
                return
            except ApiError as e:
                self.mesh.close(sub.request_id)
                # right after a death the mesh may have no scheduler or worker to offer until one is back
                if e.status != 503 or time.monotonic() + pause > min(give_up, self.deadline):
                    self.close("migration refused")
                    raise
            await asyncio.sleep(pause)  # 0.2 s, doubling up to 1 s: a few submits a second per choice
            pause = min(2 * pause, 1.0)
            sub = run.renew(sub)

    def _observe(self, k: int, n_tokens: int) -> None:
        if not n_tokens:
            return
        now = time.monotonic()
        if not self._first_token:
            self._first_token = True
            self.metrics.ttft.observe(now - self.arrival)
        tally = self.metrics.tally
        last = self._last_token_at[k]
        if last is not None:
            tally.itl((now - last) / n_tokens, n_tokens)
        self._last_token_at[k] = now
        tally.tokens += n_tokens

    def close(self, reason: str = "client went away") -> None:
        """Cancel every unfinished choice and forget all of them. Idempotent and synchronous."""
        if self._closed:
            return
        self._closed = True
        for out, rid in zip(self.outputs, self.request_ids, strict=True):
            self.mesh.close(rid, None if out.done else reason)

    def usage(self) -> Usage:
        cached: dict[int, int] = {}
        for c, out in zip(self.plan.choices, self.outputs, strict=True):
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), out.cached_tokens)
        return Usage(
            prompt_tokens=sum(len(p) for p in self.plan.prompts),
            completion_tokens=sum(o.completion_tokens for o in self.outputs),
            cached_tokens=sum(cached.values()),
        )

    def choices(self) -> list[Choice]:
        return [
            Choice(o.index, o.full_text(), o.finish_reason, o.logprobs if self.plan.logprobs else None)
            for o in self.outputs
        ]
