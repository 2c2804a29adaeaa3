"""When the gateway can serve a request, for `GET /ready` (the readiness probe; /health stays liveness)."""

# Ready means a request admitted now could run: a scheduler replica is live (SchedulerHeartbeat), and a
# decode worker serving this gateway's model is live and not draining (WorkerHeartbeat). A prompt then
# has a path: a live prefill worker of the model, or else the decode worker prefills it itself (the
# scheduler's decode-local fallback, services/scheduler/failover.py), so no prefill worker is required;
# /ready names which path prompts take. Liveness is libs.liveness's rule: unheard for
# `dead_after_intervals` heartbeat periods, or gone at once on WorkerGone.
#
# `MeshReadiness` is pure (times passed in); `ReadinessWatch` feeds it from the bus.

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from libs.bus import Bus
from libs.liveness import LivenessTable
from proto import messages as m
from proto import subjects


@dataclass(frozen=True)
class _Worker:
    role: m.Role
    model: str
    draining: bool


@dataclass(frozen=True)
class Readiness:
    """`reason` is None when ready; `prompt_path` says where prompts are prefilled."""

    reason: str | None
    decode_workers: int
    prefill_workers: int
    schedulers: int

    @property
    def prompt_path(self) -> str:
        return "prefill-worker" if self.prefill_workers else "decode-local prefill"


class MeshReadiness:
    def __init__(self, model: str, dead_after_intervals: float = 3.0) -> None:
        self.model = model
        self.table = LivenessTable(dead_after_intervals)
        self._workers: dict[str, _Worker] = {}
        self._schedulers: set[str] = set()

    def observe(self, msg: m.WorkerHeartbeat | m.WorkerGone | m.SchedulerHeartbeat, now: float) -> None:
        match msg:
            case m.WorkerHeartbeat(worker_id=wid, interval_ms=interval) if interval > 0:
                self.table.beat(wid, interval, now)
                if wid in self.table:  # the table is bounded; so is this
                    self._workers[wid] = _Worker(msg.role, msg.model, msg.draining)
            case m.WorkerGone(worker_id=wid):
                self.table.gone(wid)
                self._workers.pop(wid, None)
            case m.SchedulerHeartbeat(scheduler_id=sid, interval_ms=interval) if interval > 0:
                self.table.beat(sid, interval, now)
                if sid in self.table:
                    self._schedulers.add(sid)

    def _live(self, role: m.Role) -> list[_Worker]:
        return [w for w in self._workers.values() if w.role == role]

    def check(self, now: float) -> Readiness:
        for node in self.table.expire(now):
            self._workers.pop(node, None)
            self._schedulers.discard(node)
        decode = [w for w in self._live(m.Role.DECODE) if w.model == self.model and not w.draining]
        prefill = [w for w in self._live(m.Role.PREFILL) if w.model == self.model and not w.draining]
        reason = None
        if not decode:
            reason = f"no live decode worker for model {self.model!r}"
            others = sorted({w.model for w in self._live(m.Role.DECODE) if w.model != self.model})
            if others:
                reason += f" (live decode workers serve {', '.join(map(repr, others))})"
            elif self._live(m.Role.DECODE):
                reason += " (every decode worker of it is draining)"
        elif not self._schedulers:
            reason = "no live scheduler"
        return Readiness(reason, len(decode), len(prefill), len(self._schedulers))


class ReadinessWatch:
    """MeshReadiness fed from worker and scheduler heartbeats on the bus."""

    def __init__(
        self, bus: Bus, model: str, dead_after_intervals: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bus, self.clock = bus, clock
        self.state = MeshReadiness(model, dead_after_intervals)

    async def start(self, subscribe: bool = True) -> None:
        """subscribe False: the owner hands every heartbeat to `observe`."""
        if subscribe:
            await self.bus.subscribe(subjects.HEARTBEAT_ALL, m.Heartbeat, self.observe)
            await self.bus.subscribe(subjects.SCHED_HEARTBEAT, m.SchedulerHeartbeat, self.observe)

    async def observe(self, msg: m.WorkerHeartbeat | m.WorkerGone | m.SchedulerHeartbeat) -> None:
        self.state.observe(msg, self.clock())

    def check(self) -> Readiness:
        return self.state.check(self.clock())
