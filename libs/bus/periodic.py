"""A background task that runs a coroutine every interval (heartbeats, beacons) until stopped, at a fixed rate
(due one interval after the previous was due; after a longer stall, from now: no burst). A failing run is
logged and the next one still happens, so liveness signals do not die with one bad moment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from libs.bus.event_wait import cancel_and_wait

log = logging.getLogger("moemesh.bus")


def next_due(due: float, now: float, interval_s: float) -> float:
    """When the next run is due: one interval after the last was due, or now when that is past (a stall
    longer than an interval is not made up with a burst)."""
    return max(due + interval_s, now)


class Periodic:
    def __init__(self, interval_s: float, fn: Callable[[], Awaitable[object]], name: str) -> None:
        self.interval_s, self.fn, self.name = interval_s, fn, name
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        due = time.monotonic()
        while True:
            try:
                await self.fn()
            except Exception as e:
                log.warning("%s failed: %s", self.name, e)
            now = time.monotonic()
            due = next_due(due, now, self.interval_s)
            await asyncio.sleep(due - now)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)  # fn may await nats-py, whose wait_for can lose a cancel
            self._task = None
