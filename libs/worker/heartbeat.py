"""Worker liveness on the bus: a WorkerHeartbeat every interval and WorkerGone on a clean stop, on the
subject of the worker's role (proto.subjects.heartbeat); with stall_dump_s > 0 every thread's stack is
dumped to stderr when no beat has gone out for that long."""

# The dump (faulthandler.dump_traceback_later, re-armed each beat) runs on faulthandler's own C thread,
# needing neither the loop nor the GIL, so it says where a silent worker was (a native call holding the GIL,
# a blocked loop, a stuck publish) before the mesh declares it dead. One such timer exists per process.

from __future__ import annotations

import contextlib
import faulthandler
import sys
import time
from typing import Any

from libs.bus import Bus
from libs.bus.periodic import Periodic
from proto import messages as m
from proto import subjects


class Heartbeater:
    """Publishes WorkerHeartbeat every interval from a stats callback; WorkerGone on stop."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        role: m.Role,
        model: str,
        interval_ms: int,
        stats: Any,
        stall_dump_s: float = 0.0,
    ) -> None:
        self.bus, self.worker_id, self.role, self.model = bus, worker_id, role, model
        self.interval_ms, self.stats, self.stall_dump_s = interval_ms, stats, stall_dump_s
        self.draining = False
        self.subject = subjects.heartbeat(role.name.lower())
        self._periodic = Periodic(interval_ms / 1000, self.beat, "heartbeat")

    def start(self) -> None:
        self._periodic.start()

    async def beat(self) -> None:
        st = self.stats()
        await self.bus.publish(
            self.subject,
            m.WorkerHeartbeat(
                worker_id=self.worker_id, role=self.role, model=self.model, running=st["running"],
                waiting=st["waiting"], free_pages=st["free_pages"], total_pages=st["total_pages"],
                page_size=st["page_size"], max_context=st["max_context"], interval_ms=self.interval_ms,
                sent_ms=int(time.time() * 1000), draining=self.draining,
                waiting_tokens=st.get("waiting_tokens", 0), max_running=st.get("max_running", 0),
                pending=st.get("pending", 0),
            ),
        )  # fmt: skip
        if self.stall_dump_s > 0:  # re-arming replaces the previous timer
            faulthandler.dump_traceback_later(self.stall_dump_s, file=sys.stderr)

    async def stop(self) -> None:
        await self._periodic.stop()
        if self.stall_dump_s > 0:
            faulthandler.cancel_dump_traceback_later()
        with contextlib.suppress(Exception):
            await self.bus.publish(self.subject, m.WorkerGone(worker_id=self.worker_id, role=self.role))
