"""Reservations waiting for their KV, watched so that none hangs (docs/operations.md, "What survives what"):
when the prefill worker named in ReserveKv dies or the lease runs out first, the request's stream gets a
retryable 503 RequestError naming that worker, and the reservation counts as cancelled."""

# The gateway migrates the request, avoiding the named worker. The pages are still freed only when the
# prefill side answers or the lease expires: a Mooncake write into them may still be landing.

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.bus import Bus
from libs.liveness import Holders, LivenessWatch
from proto import messages as m

log = logging.getLogger("moemesh.decode")


class ReservationGuard:
    def __init__(self, bus: Bus, on_lost: Callable[[str], None], dead_after_intervals: float = 3.0) -> None:
        self.bus, self.on_lost = bus, on_lost
        self.holders = Holders()  # request id -> its prefill worker
        self._streams: dict[str, str] = {}
        self.watch = LivenessWatch(  # prefill workers only: a decode worker never hears its decode peers
            bus, self._on_dead, roles=(m.Role.PREFILL,), schedulers=False, dead_after_intervals=dead_after_intervals
        )

    async def start(self) -> None:
        await self.watch.start()

    async def stop(self) -> None:
        await self.watch.stop()

    def __len__(self) -> int:
        return len(self._streams)

    def track(self, rid: str, prefill_worker: str, stream_subject: str) -> None:
        if not stream_subject:
            return  # a ReserveKv naming no stream: nobody to tell; the lease still frees the pages
        self._streams[rid] = stream_subject
        if prefill_worker:
            self.holders.set(rid, prefill_worker)
            self.watch.watch(prefill_worker)

    def untrack(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self.holders.drop(rid)

    async def lost(self, rid: str, message: str, worker_id: str = "") -> None:
        """Tell the gateway the request must move; the reservation counts as cancelled from now on."""
        subject = self._streams.get(rid)
        self.untrack(rid)
        if subject is None:
            return
        self.on_lost(rid)
        log.warning("reservation of %s lost: %s", rid, message)
        err = m.RequestError(request_id=rid, code=503, message=message, worker_id=worker_id)
        with contextlib.suppress(Exception):
            await self.bus.publish(subject, err)

    async def _on_dead(self, nodes: list[str]) -> None:
        for node in nodes:
            for rid in self.holders.items_of(node):
                await self.lost(rid, f"prefill worker {node} died before the KV arrived", node)


@dataclass
class LeaseBackstop:
    """The decode side's own end for reservations nobody answers (pure): `due` names those past their
    backstop deadline (one more lease length after the lease ends, so no late Mooncake write can still land)
    and forgets those that ended otherwise."""

    # The broker's HandleExpired is the normal end of a lease; when the bus loses it, or the CreateHandle that
    # would have let the broker expire the handle (a nats-server restart), the pages would stay reserved.

    _deadlines: dict[str, tuple[str, float]] = field(default_factory=dict)  # handle id -> (request id, when)

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, handle_id: object) -> bool:
        return handle_id in self._deadlines

    def add(self, handle_id: str, rid: str, deadline: float) -> None:
        self._deadlines[handle_id] = (rid, deadline)

    def due(self, now: float, still_reserved: Callable[[str, str], bool]) -> list[tuple[str, str]]:
        """(handle id, request id) of the reservations still held at `now` past their deadline; entries
        whose reservation ended (joined or freed) are dropped."""
        out = []
        for handle_id, (rid, deadline) in list(self._deadlines.items()):
            if not still_reserved(rid, handle_id):
                del self._deadlines[handle_id]
            elif now >= deadline:
                del self._deadlines[handle_id]
                out.append((handle_id, rid))
        return out
