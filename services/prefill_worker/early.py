"""Prompts started before their KV handle is known (PrefillStart, the scheduler's overlap_prefill): the
prefill runs while the decode worker reserves pages; the PrefillTask that follows takes its result."""

# Invariants: at most one started prompt per request id; a dropped one (PrefillAbandon, Cancel, no
# PrefillTask within `ttl_s`, shutdown) has its pages released on the engine thread exactly once, and a
# new start for the same id waits for that release (the engine refuses an id still pinned).

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("moemesh.prefill.early")


class EarlyPrefills:
    def __init__(self, release: Callable[[str], Awaitable[Any]], ttl_s: float, clock=time.monotonic) -> None:
        """release(rid): unpin a prefilled prompt on the engine thread."""
        self._release, self.ttl_s, self.clock = release, ttl_s, clock
        self._started: dict[str, tuple[asyncio.Task, float]] = {}
        self._releasing: dict[str, asyncio.Task] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._started

    def __len__(self) -> int:
        return len(self._started)

    def start(self, rid: str, run: Callable[[], Awaitable[Any]]) -> bool:
        """Begin `run()` (the engine prefill) for rid, after any release of an earlier one; False when
        rid is already started."""
        if rid in self._started:
            return False
        pending = self._releasing.get(rid)

        async def after_release() -> Any:
            if pending is not None:
                with contextlib.suppress(Exception):
                    await pending
            return await run()

        task = asyncio.create_task(after_release())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved by take() or drop()
        self._started[rid] = (task, self.clock() + self.ttl_s)
        return True

    def take(self, rid: str) -> asyncio.Task | None:
        """The started prefill of rid (its result is the PrefillTask's now), or None."""
        entry = self._started.pop(rid, None)
        return entry[0] if entry else None

    def drop(self, rid: str) -> bool:
        """Forget rid's started prefill and release its pages once it has finished."""
        entry = self._started.pop(rid, None)
        if entry is None:
            return False
        task = asyncio.create_task(self._release_after(rid, entry[0]))
        self._releasing[rid] = task
        task.add_done_callback(
            lambda _: self._releasing.pop(rid, None) if self._releasing.get(rid) is task else None
        )
        return True

    async def _release_after(self, rid: str, task: asyncio.Task) -> None:
        with contextlib.suppress(Exception):
            await task
        try:
            await self._release(rid)
        except Exception as e:  # the engine call itself failed: nothing more to do here
            log.warning("releasing the early prefill of %s failed: %s", rid, e)

    def expire(self) -> list[str]:
        """Drop every start whose PrefillTask did not come within ttl_s."""
        now = self.clock()
        late = [rid for rid, (_, until) in self._started.items() if until < now]
        for rid in late:
            log.warning("no PrefillTask for the early prefill of %s within %.1f s: dropped", rid, self.ttl_s)
            self.drop(rid)
        return late

    async def close(self) -> None:
        for rid in list(self._started):
            self.drop(rid)
        if self._releasing:
            await asyncio.gather(*self._releasing.values(), return_exceptions=True)
