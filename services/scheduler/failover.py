"""What the scheduler adds for failover, kept out of the policy and the service shell."""

# - `place`: the policy's decision for a request, without the workers the request must avoid (a
#   migrating request names the worker it lost; the scheduler may not have seen that death yet; an avoided
#   decode worker is still tried when no other live one serves the model), without
#   decode workers whose waiting line is full (`max_waiting`: requests placed but not yet running; free
#   pages alone do not bound it, since a decode-direct request takes its pages only when it starts;
#   `waiting_line` estimates it between heartbeats), and
#   with decode-local prefill as the fallback when no prefill worker can take it (all dead or avoided):
#   any decode worker can prefill a prompt itself, only slower. Pure.
# - `placed_notice`: the message that tells the gateway which decode worker now holds a request, so the
#   gateway can watch that worker from placement on (not only from the first token).
# - `SchedulerBeacon`: this replica's heartbeat (SchedulerHeartbeat), so gateways see a replica die with
#   requests still in its queue.

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from libs.bus import Bus
from libs.bus.periodic import Periodic
from proto import messages as m
from proto import subjects
from services.scheduler.policy import (
    Decision,
    PlacementRequest,
    Plan,
    PolicyConfig,
    Refuse,
    Wait,
    WorkerState,
    schedule,
    serves,
)

log = logging.getLogger("moemesh.scheduler")


def place(
    workers: Sequence[WorkerState],
    req: PlacementRequest,
    config: PolicyConfig,
    prefix_hits: Mapping[str, int] | None = None,
    avoid: Collection[str] = (),
    max_waiting: int = 0,
) -> Decision:
    usable = [w for w in workers if w.worker_id not in avoid] if avoid else workers
    dec = m.Role.DECODE
    if avoid and not any(serves(w, dec, req.model) for w in usable):
        # Every live decode worker of the model is one this request lost, yet alive by this scheduler's own
        # heartbeats: back from a stall (its heartbeats resumed), or dead and not yet expired here. A try
        # there beats a refusal that no retry with the same avoid list could lift while it stays the only one.
        usable = [w for w in workers if w.hb.role == dec or w.worker_id not in avoid]
    # one pass in the common case (no decode line full), the filter only when one is
    if max_waiting > 0 and any(w.hb.role == dec and waiting_line(w) >= max_waiting for w in usable):
        usable = [w for w in usable if not (w.hb.role == dec and waiting_line(w) >= max_waiting)]
        if not any(w.hb.role == m.Role.DECODE for w in usable):  # the request waits in the bounded queue
            return Wait(f"every decode worker has {max_waiting} requests waiting")
    decision = schedule(usable, req, config, prefix_hits)
    if isinstance(decision, Refuse) and decision.code == m.ErrorCode.UNAVAILABLE:
        # No prefill worker (a decode refusal repeats itself below): prefill on the decode worker.
        local = dataclasses.replace(config, direct_prefill_threshold=max(1, req.prompt_len))
        fallback = schedule(usable, req, local, prefix_hits)
        if isinstance(fallback, Plan):
            return fallback
    return decision


def waiting_line(w: WorkerState) -> int:
    """Requests waiting to join the decode worker's running batch, as far as the scheduler knows (an upper
    bound): those its last heartbeat reported, plus the placements since (`inflight`) and the accepted but
    unstarted ones (`pending`) its batch has no slot for."""
    # With no line at the heartbeat only placements beyond `max_running - running` wait (a placement joins
    # the next step while a slot is free; finishes are unseen until the next heartbeat); with a line, every
    # placement since waits behind it; from a worker that does not report its batch size, every one counts.
    hb = w.hb
    if hb.waiting > 0 or hb.max_running <= 0:
        return hb.waiting + hb.pending + w.inflight
    return max(0, hb.running + hb.pending + w.inflight - hb.max_running)


def placed_notice(request_id: str, decode_worker: str) -> m.TokenBatch:
    """An empty delta naming the request's decode worker (see TokenBatch.worker_id)."""
    return m.TokenBatch(deltas=[m.TokenDelta(request_id, [])], worker_id=decode_worker)


class SchedulerBeacon:
    """Publishes SchedulerHeartbeat every `interval_ms` until stopped."""

    def __init__(self, bus: Bus, scheduler_id: str, interval_ms: int, queued: Callable[[], int]) -> None:
        self.bus, self.scheduler_id, self.interval_ms, self.queued = bus, scheduler_id, interval_ms, queued
        self._periodic = Periodic(interval_ms / 1000, self.beat, "scheduler-beacon")

    def start(self) -> None:
        self._periodic.start()

    async def beat(self) -> None:
        hb = m.SchedulerHeartbeat(
            scheduler_id=self.scheduler_id, interval_ms=self.interval_ms,
            sent_ms=int(time.time() * 1000), queued=self.queued(),
        )  # fmt: skip
        await self.bus.publish(subjects.SCHED_HEARTBEAT, hb)

    async def stop(self) -> None:
        await self._periodic.stop()
