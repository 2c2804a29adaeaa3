"""A LivenessTable fed from the bus: worker heartbeats of the roles the caller relies on
(proto.subjects.heartbeat: WorkerHeartbeat / WorkerGone) and, when asked, scheduler heartbeats
(SCHED_HEARTBEAT), with a timer that declares the silent dead."""

# Silence is measured on a StallClock: time this process's own event loop spent stalled (heartbeats
# waiting unread) does not count against anyone, so a loaded process does not declare its peers dead.
# A process that already subscribes to heartbeats passes `subscribe=False` to `start` and hands each
# message to `on_worker` / `on_scheduler` (one delivery per heartbeat per process, not one per user).
#
# Caller side: `watch(node)` before relying on a node (an unknown one gets a grace period), and the
# callbacks `on_dead(node_ids)` (once per death) and `on_reconnect()` (this process's own bus
# connection came back: messages may have been lost meanwhile). While our own connection is down, silence
# proves nothing, so nobody is declared dead then; afterwards everyone gets a fresh grace period.

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection

from libs.bus import Bus
from libs.bus.event_wait import wait_event
from libs.liveness.stall_clock import StallClock
from libs.liveness.table import LivenessTable
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.liveness")

OnDead = Callable[[list[str]], Awaitable[None]]
OnReconnect = Callable[[], Awaitable[None]]


class LivenessWatch:
    def __init__(
        self,
        bus: Bus,
        on_dead: OnDead,
        *,
        on_reconnect: OnReconnect | None = None,
        roles: Collection[m.Role] = (m.Role.DECODE, m.Role.PREFILL),
        schedulers: bool = True,
        dead_after_intervals: float = 3.0,
        default_interval_ms: float = 250.0,
        tick_s: float = 0.1,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.bus, self.on_dead, self.on_reconnect = bus, on_dead, on_reconnect
        self.roles, self.schedulers = tuple(roles), schedulers
        self.table = LivenessTable(dead_after_intervals, default_interval_ms)
        self.stall_clock = StallClock() if clock is None else None
        self.tick_s = tick_s
        self.clock: Callable[[], float] = clock or self.stall_clock or time.monotonic
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self, subscribe: bool = True) -> None:
        if subscribe:
            for role in self.roles:
                await self.bus.subscribe(subjects.heartbeat(role.name.lower()), m.Heartbeat, self.on_worker)
            if self.schedulers:
                await self.bus.subscribe(subjects.SCHED_HEARTBEAT, m.SchedulerHeartbeat, self.on_scheduler)
        if self.stall_clock is not None:
            self.stall_clock.start()
        self._task = asyncio.create_task(self._loop(), name="liveness-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.stall_clock is not None:
            await self.stall_clock.stop()

    def watch(self, node_id: str) -> None:
        """Start relying on `node_id`: unknown, it is assumed alive for one grace period."""
        if node_id and node_id not in self.table:
            self.table.assume(node_id, self.clock())
            self._wake.set()

    async def on_worker(self, msg: m.WorkerHeartbeat | m.WorkerGone) -> None:
        match msg:
            case m.WorkerHeartbeat(worker_id=wid, interval_ms=interval):
                self._beat(wid, interval)
            case m.WorkerGone(worker_id=wid):
                if self.table.gone(wid):
                    await self._report([wid])

    async def on_scheduler(self, msg: m.SchedulerHeartbeat) -> None:
        self._beat(msg.scheduler_id, msg.interval_ms)

    def _beat(self, node_id: str, interval_ms: int) -> None:
        try:
            self.table.beat(node_id, interval_ms, self.clock())
        except ValueError as e:
            log.warning("ignored heartbeat: %s", e)

    async def _report(self, dead: list[str]) -> None:
        log.warning("no heartbeat from %s: considered dead", ", ".join(dead))
        try:
            await self.on_dead(dead)
        except Exception:  # a failing callback must not stop the watch
            log.exception("liveness callback failed")

    async def _loop(self) -> None:
        seen_reconnects = self.bus.reconnects
        while True:
            now = self.clock()
            if self.bus.is_connected:
                if (n := self.bus.reconnects) != seen_reconnects:
                    seen_reconnects = n
                    self.table.restart_clock(now)
                    log.info("bus reconnected: liveness clocks restarted")
                    if self.on_reconnect is not None:
                        try:
                            await self.on_reconnect()
                        except Exception:
                            log.exception("reconnect callback failed")
                dead = self.table.expire(now)
                if dead:
                    await self._report(dead)
            nxt = self.table.next_expiry()
            wait = self.tick_s if nxt is None else min(self.tick_s, max(0.0, nxt - now) + 0.001)
            await wait_event(self._wake, wait)
            self._wake.clear()
