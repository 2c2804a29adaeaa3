"""The launcher's supervision loop: a thread that runs `Supervisor.poll` a few times a second, reports exits,
restarts and give-ups, and publishes `LauncherStatus` every second and on every change (a gateway exports
it). While the bus is down it keeps supervising; only the publishing waits (the bus reconnects on its own)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from libs.bus.bus import Bus, BusError
from libs.launch import restart_policy as rp
from libs.launch.supervisor import Supervisor
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.launch")

POLL_S = 0.2
PUBLISH_EVERY_S = 1.0
_STATUS = {
    rp.State.UP: m.ServiceStatus.UP,
    rp.State.RESTARTING: m.ServiceStatus.RESTARTING,
    rp.State.GIVEN_UP: m.ServiceStatus.GIVEN_UP,
    rp.State.STOPPED: m.ServiceStatus.STOPPED,
}


def status_message(
    launcher_id: str, records: Mapping[str, rp.ServiceRecord], interval_ms: int, now_ms: int
) -> m.LauncherStatus:
    services = [
        m.ServiceState(name=n, status=_STATUS[r.state], restarts=r.restarts, last_exit_code=r.last_exit_code)
        for n, r in sorted(records.items())
    ]
    return m.LauncherStatus(
        launcher_id=launcher_id, services=services, interval_ms=interval_ms, sent_ms=now_ms
    )


class SupervisionLoop:
    """Runs in its own thread from `start()` to `stop()`; `report` gets every line for the operator."""

    def __init__(
        self, sup: Supervisor, nats_url: str, connect_options: dict[str, Any],
        report: Callable[[str], None] = log.warning, launcher_id: str = "",
    ) -> None:  # fmt: skip
        self.sup, self.nats_url, self.connect_options, self.report = sup, nats_url, connect_options, report
        self.launcher_id = launcher_id or f"launcher-{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="moemesh-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        bus: Bus | None = None
        connecting = asyncio.create_task(self._connect())
        last: m.LauncherStatus | None = None
        try:
            while not self._stop.is_set():
                self._step()
                if bus is None and connecting.done():
                    bus = connecting.result()
                now_ms = int(time.time() * 1000)
                msg = status_message(
                    self.launcher_id, dict(self.sup.records), int(PUBLISH_EVERY_S * 1000), now_ms
                )
                stale = last is None or now_ms - last.sent_ms >= PUBLISH_EVERY_S * 1000
                if bus is not None and (stale or msg.services != last.services):  # type: ignore[union-attr]
                    await self._publish(bus, msg)
                    last = msg
                await asyncio.sleep(POLL_S)  # child exits have no event to await here; poll them
        finally:
            connecting.cancel()
            if bus is not None:
                with contextlib.suppress(Exception):  # closing over a lost connection may raise
                    await bus.close()

    def _step(self) -> None:
        try:
            lines = self.sup.poll()
        except Exception as e:  # e.g. a restart that could not even spawn: say so, keep supervising
            lines = [f"supervisor step failed: {type(e).__name__}: {e}"]
        for line in lines:
            self.report(line)
        if lines:
            self.report(self.sup.summary())

    async def _connect(self) -> Bus | None:
        try:
            return await Bus.connect(self.nats_url, "launcher", connect_deadline=30, **self.connect_options)
        except BusError as e:
            self.report(f"launcher status is not published: {e}")
            return None

    async def _publish(self, bus: Bus, msg: m.LauncherStatus) -> None:
        try:
            await bus.publish(subjects.LAUNCHER_STATUS, msg)
        except Exception as e:  # the bus is down or reconnecting: the next round publishes again
            log.debug("launcher status not published: %s", e)
