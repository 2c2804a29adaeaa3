"""`PrefillLoop`: the prefill worker's batched prefill over the engine thread."""

# Tasks call `prefill(rid, prompt, params)` and await their own `PrefillResult`. One loop task drives the
# engine: each round, on the engine thread, it aborts what was dropped, queues every prompt that arrived
# since the last round (`Engine.add_prefill`) and runs one `Engine.step()`, so prompts that arrive while a
# forward runs share the next one: the engine's Batcher packs their chunks under `max_prefill_tokens`
# (long prompts chunked, prefix cache reused). A prompt's result is handed back from the round whose step
# ran its last chunk; its pages stay pinned until `release(rid)`.
#
# A task gets its result as soon as the step that finished its prompt returns, so its KV write starts off
# the engine thread while the loop's next round computes the other prompts. A prompt longer than one chunk
# starts earlier still: after every step the loop reads which of its pages are final
# (`Engine.prefill_progress`) and hands them to the prompt's watcher (`watch`; kv_stream.py writes them),
# so its earlier chunks' KV travels while its later chunks compute. On CUDA the pages come with a fence
# (an event recorded after the step) that the writer waits on before reading them.
#
# A round with few prompt tokens left (`inline_max_tokens`) runs on the event loop when the engine thread is
# idle (`EngineThread.run_inline`): a lone short prompt on an idle worker pays no thread hand-off before its
# first token.
#
# Failures: a prompt the engine refuses (ValueError) fails alone; a step that raises fails every prompt in
# the engine with that error (they are aborted in the next round, so no page stays held). `drop` (a
# cancel) fails a queued prompt at once and aborts one already in the engine before the next step.

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from libs.bus.event_wait import cancel_and_wait
from libs.engine.outputs import PrefillResult, StepOutput
from libs.engine.protocol import EngineLike
from libs.engine.sampling import SamplingParams
from libs.worker.engine_thread import EngineThread

Fence = Callable[[], None]  # returns once the device has written what the step computed
Watcher = Callable[[list[int], Fence | None], None]  # (the prompt's final pages so far, their fence)
Round = tuple[dict[str, Exception], list[StepOutput], bool, dict[str, list[int]], Fence | None]


class PrefillLoop:
    def __init__(
        self,
        engine: EngineLike,
        et: EngineThread,
        on_step: Callable[[int, float], object] | None = None,
        max_prompts: int = 0,
        inline_max_tokens: int = 0,
    ) -> None:
        """on_step(prompts in the engine, step seconds) runs on the event loop after every step. max_prompts:
        most prompts in the engine at once, the rest wait in arrival order (0: no limit). inline_max_tokens: a
        round with at most this many tokens left runs on the event loop when the engine thread is idle (0: never)."""
        self.engine, self.et, self.on_step, self.max_prompts = engine, et, on_step, max_prompts
        self.inline_max_tokens = inline_max_tokens
        self.inline_rounds = 0  # rounds run on the event loop
        self._queued: dict[str, tuple[list[int], SamplingParams]] = {}  # submitted, not yet in the engine
        self._lengths: dict[str, int] = {}  # prompt tokens of every prompt not yet reported
        self._in_engine: set[str] = set()  # added to the engine, result not yet reported
        self._futures: dict[str, asyncio.Future[PrefillResult]] = {}  # waiting tasks, queued or in the engine
        self._drop: set[str] = set()  # to abort in the engine before the next step
        self._progress: dict[str, list[int]] = {}  # in the engine: its final pages after the last step
        self._watchers: dict[str, Watcher] = {}
        self._last_fence: Fence | None = None  # the latest fence: it also covers every earlier step
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.forwards = 0  # engine steps run
        self.step_seconds = 0.0  # the last engine step's time

    @property
    def waiting(self) -> int:
        """Prompts submitted and not yet reported (queued or in the engine)."""
        return len(self._futures)

    def backlog(self) -> tuple[int, int]:
        """(prompts queued for the engine, prompt tokens not yet computed of those and of the ones in the
        engine, counted in whole pages as the engine reports them final)."""
        done = sum(len(p) for p in self._progress.values()) * self.engine.page_size
        return len(self._queued), max(sum(self._lengths.values()) - done, 0)

    def watch(self, rid: str, watcher: Watcher) -> None:
        """Call watcher(pages, fence) on the event loop whenever the prompt's final pages change (at once
        with what is known now); [] after a preemption means every page may be recomputed elsewhere."""
        self._watchers[rid] = watcher
        if self._progress.get(rid):
            watcher(self._progress[rid], self._last_fence)

    def unwatch(self, rid: str) -> None:
        self._watchers.pop(rid, None)

    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self._loop(), name="prefill-loop")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)  # again while it runs on: a cancel lost in nats-py's wait_for
        for rid in list(self._futures):
            self._fail(rid, RuntimeError("prefill worker is stopping"))

    async def prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> PrefillResult:
        """The prompt's first token and pinned pages, once the step that ran its last chunk returns."""
        if rid in self._futures:
            raise ValueError(f"request id {rid!r} is already in use")
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        self._queued[rid] = (list(prompt_ids), params)
        self._lengths[rid] = len(self._queued[rid][0])
        self._wake.set()
        try:
            return await fut
        finally:
            if self._futures.get(rid) is fut:  # the awaiting task itself was cancelled
                self.drop(rid, asyncio.CancelledError())

    def drop(self, rid: str, exc: BaseException) -> None:
        """Fail a prompt not yet reported with `exc` and take it out of the batch (cancel)."""
        if rid in self._queued:
            del self._queued[rid]
        elif rid in self._in_engine:
            self._drop.add(rid)
            self._wake.set()
        self._fail(rid, exc)

    async def release(self, rid: str) -> None:
        """Unpin a reported prompt's pages (after its transfer, or on failure); wakes a stalled loop."""
        with contextlib.suppress(Exception):
            await self.et.call(self.engine.release, rid)
        self._wake.set()

    def _fail(self, rid: str, exc: BaseException) -> None:
        self._progress.pop(rid, None)
        self._lengths.pop(rid, None)
        fut = self._futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    async def _loop(self) -> None:
        while True:
            if not (self._queued or self._drop or self._in_engine):
                self._wake.clear()
                await self._wake.wait()
                continue
            new = self._take_queued()
            drop, self._drop = self._drop, set()
            self._in_engine |= new.keys()
            self._wake.clear()
            forwards = self.forwards
            running = tuple(self._in_engine)
            inline = None
            if self.inline_max_tokens and self.backlog()[1] <= self.inline_max_tokens:
                inline = self.et.run_inline(self._round, new, drop, running)  # None: the thread is busy
                self.inline_rounds += inline is not None
            step = inline if inline is not None else self.et.submit(self._round, new, drop, running)
            try:
                errors, outs, stalled, progress, fence = await step  # a done future returns at once
            except Exception as e:  # the step failed: so does every prompt it held
                self._in_engine -= drop
                for rid in self._in_engine:
                    self._fail(rid, e)
                self._drop |= self._in_engine
                self._in_engine = set()
                continue
            self._in_engine -= drop
            if self.on_step is not None and self.forwards > forwards:
                self.on_step(len(self._in_engine) - len(errors), self.step_seconds)
            self._report(errors, outs)
            self._notify(progress, fence)
            if stalled and not self._drop:
                await self._wake.wait()  # every page is pinned: a release, a new task or a drop wakes us
            elif inline is not None:
                await asyncio.sleep(0)  # rounds on the loop never run back to back: the bus is served between

    def _take_queued(self) -> dict[str, tuple[list[int], SamplingParams]]:
        room = self.max_prompts - len(self._in_engine) if self.max_prompts else len(self._queued)
        rids = list(self._queued)[: max(room, 0)]
        return {rid: self._queued.pop(rid) for rid in rids}

    def _round(
        self, new: dict[str, tuple[list[int], SamplingParams]], drop: set[str], running: tuple[str, ...]
    ) -> Round:
        """On the engine thread: abort, queue, one step, then the final pages of the prompts still running."""
        for rid in drop:
            self.engine.abort(rid)
        errors: dict[str, Exception] = {}
        for rid, (prompt, params) in new.items():
            try:
                self.engine.add_prefill(rid, prompt, params)
            except ValueError as e:
                errors[rid] = e
        if not self.engine.has_unfinished():
            return errors, [], False, {}, None
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.step_seconds = time.perf_counter() - t0
        self.forwards += 1
        progress = {rid: self.engine.prefill_progress(rid) for rid in running if rid not in drop}
        return errors, outs, self.engine.stalled, progress, self._fence(progress)

    def _fence(self, progress: dict[str, list[int]]) -> Fence | None:
        """On CUDA the step's kernels may still run when step() returns: an event to wait on before reading."""
        if not any(progress.values()) or not self.engine.kv_pool.buffer.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def _notify(self, progress: dict[str, list[int]], fence: Fence | None) -> None:
        if fence is not None:
            self._last_fence = fence
        for rid, pages in progress.items():
            if rid not in self._in_engine or rid not in self._futures or pages == self._progress.get(rid, []):
                continue  # reported or dropped meanwhile (its result carries every page), or nothing new
            self._progress[rid] = pages
            watcher = self._watchers.get(rid)
            if watcher is not None:
                watcher(pages, fence)

    def _report(self, errors: dict[str, Exception], outs: list[StepOutput]) -> None:
        for rid, e in errors.items():
            self._in_engine.discard(rid)
            self._fail(rid, e)
        for o in outs:
            if o.prefill is None:
                continue
            self._in_engine.discard(o.rid)
            self._progress.pop(o.rid, None)
            self._lengths.pop(o.rid, None)
            fut = self._futures.pop(o.rid, None)
            if fut is None or fut.done():  # dropped while its last chunk ran: unpin it next round
                self._drop.add(o.rid)
            else:
                fut.set_result(o.prefill)
