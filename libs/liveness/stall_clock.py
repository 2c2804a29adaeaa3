"""A monotonic clock that stands still while this process's event loop is stalled."""

# Silence from a peer proves it dead only while we were listening. When our own loop is blocked or
# saturated (a long callback, a GC pause, a starved CPU on a loaded host), the peer's heartbeats wait
# unread in the socket, and a wall clock would count that time as the peer's silence: the false deaths a
# loaded process sees. This clock excludes those stalls, so a liveness table fed with its readings counts
# missed heartbeat intervals, not our own jitter.
#
# How: a monitor task wakes every `tick_s`; a wake later than `slack_s` past its due time is a stall,
# and that excess is subtracted. A reading taken while the monitor is overdue (inside a stall that has
# not ended yet) already stands still, so the first callback after a stall never sees the stall's time.
# Without a running monitor (not started) it reads the base clock.
#
# Side: the owner `start()`s and `stop()`s it on its loop; anyone may read it (`clock()`).

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable


class StallClock:
    def __init__(
        self, tick_s: float = 0.05, slack_s: float = 0.02, base: Callable[[], float] = time.monotonic
    ) -> None:
        if not tick_s > 0 or slack_s < 0:
            raise ValueError(f"tick_s must be > 0 and slack_s >= 0, got {tick_s}, {slack_s}")
        self.tick_s, self.slack_s, self.base = tick_s, slack_s, base
        self.stalled_s = 0.0  # stalls measured so far (ended ones)
        self.stalls = 0
        self._due: float | None = None  # base time the monitor should next run
        self._task: asyncio.Task | None = None

    def __call__(self) -> float:
        t = self.base()
        return t - self.stalled_s - self._overdue(t)

    def _overdue(self, t: float) -> float:
        return 0.0 if self._due is None else max(0.0, t - self._due - self.slack_s)

    def mark(self, t: float) -> None:
        """The monitor ran at base time `t` (pure step, public for tests)."""
        late = self._overdue(t)
        if late > 0:
            self.stalled_s += late
            self.stalls += 1
        self._due = t + self.tick_s

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stall-clock")

    async def _run(self) -> None:
        while True:
            self.mark(self.base())
            await asyncio.sleep(self.tick_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._due = None
