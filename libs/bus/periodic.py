"""A background task that runs a coroutine every interval (heartbeats, beacons) until stopped.

A failing run (e.g. a publish while the connection is reconnecting) is logged and the next one still
happens: liveness signals must not die with one bad moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("moemesh.bus")


class Periodic:
    def __init__(self, interval_s: float, fn: Callable[[], Awaitable[object]], name: str) -> None:
        self.interval_s, self.fn, self.name = interval_s, fn, name
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        while True:
            try:
                await self.fn()
            except Exception as e:
                log.warning("%s failed: %s", self.name, e)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
