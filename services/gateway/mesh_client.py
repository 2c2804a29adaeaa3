"""The gateway's side of the bus: submit to the scheduler, route streamed tokens, cancel."""

# One subscription to `proto.subjects.stream(gateway_id)` receives every TokenBatch / RequestError
# meant for this gateway; the bus decodes each message once and `_on_stream` routes each delta to the
# queue its request registered with `open()`. A delta for a request no longer in the table (finished,
# cancelled, timed out) is dropped: the table is the only per-request state, and `close()` always
# removes the entry, so nothing leaks whichever way a request ends.
#
# Invariant: a request is registered *before* its Submit is sent, so no early token can be missed.
#
# Holders: each request's current holder is known (the scheduler replica named in SubmitReply until a
# TokenBatch names its decode worker) and watched through heartbeats (libs.liveness). When a holder
# dies, or this gateway's own connection comes back (messages may have been lost), each affected request
# gets a retryable RequestError in its queue, and the Generation migrates it.
#
# Local scheduler (`embedded_scheduler`): when this process hosts a scheduler that takes work, a Submit is
# handed to it directly (`LocalScheduler.submit`) instead of going over the bus; it answers with the same
# SubmitReply or raises the same bus errors, so `submit` turns both into the same outcomes. While it does not
# take work (starting, draining), submits go over the bus to the other replicas.

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from libs.bus.bus import Bus, BusError, NoResponders, RequestRejected, RequestTimeout
from libs.liveness import Holders, LivenessWatch
from proto import messages as m
from proto import subjects
from proto.messages import Cancel, RequestError, StreamMessage, Submit, SubmitReply, TokenBatch, TokenDelta
from services.gateway.errors import ApiError, mesh_error

log = logging.getLogger("moemesh.gateway.mesh")

StreamItem = TokenDelta | RequestError


class Sink(Protocol):
    """Where a request's items go (an asyncio.Queue, or the Generation's lighter Inbox)."""

    def put_nowait(self, item: tuple[int, StreamItem], /) -> None: ...


class LocalScheduler(Protocol):
    """A scheduler in this process (services/gateway/embedded_scheduler.py)."""

    def taking_work(self) -> bool: ...

    async def submit(self, msg: Submit, timeout: float) -> SubmitReply:
        """What `Bus.request` to SCHED_SUBMIT returns or raises, answered in this process."""
        ...


@dataclass(frozen=True)
class _Route:
    queue: Sink
    tag: int  # the caller's index for this request (its choice number)


class MeshClient:
    """Submit / stream / cancel for every request of one gateway process."""

    def __init__(
        self,
        bus: Bus,
        gateway_id: str,
        dead_after_intervals: float = 3.0,
        local: LocalScheduler | None = None,
    ) -> None:
        self.bus = bus
        self.local = local  # a scheduler in this process: submits skip the bus hop while it takes work
        self.gateway_id = subjects.check_token(gateway_id)
        self.stream_subject = subjects.stream(gateway_id)
        self._routes: dict[str, _Route] = {}
        self._background: set[asyncio.Task] = set()
        self.dropped_deltas = 0
        self.holders = Holders()
        self.liveness = LivenessWatch(  # holders are decode workers and scheduler replicas
            bus, self._on_dead, on_reconnect=self._on_reconnect, roles=(m.Role.DECODE,),
            dead_after_intervals=dead_after_intervals,
        )  # fmt: skip

    async def start(self, heartbeats: bool = True) -> None:
        """heartbeats False: the owner subscribes to heartbeats and hands them to `self.liveness`."""
        await self.liveness.start(subscribe=heartbeats)
        await self.bus.subscribe(self.stream_subject, StreamMessage, self._on_stream)
        await self.bus.flush()  # the subscription is live at the server before any Submit names it

    @property
    def in_flight(self) -> int:
        """Requests registered and not yet closed."""
        return len(self._routes)

    def open(self, request_id: str, queue: Sink, tag: int) -> None:
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._routes[request_id] = _Route(queue, tag)

    async def _on_stream(self, msg: TokenBatch | RequestError) -> None:
        match msg:
            case TokenBatch(deltas=deltas, worker_id=wid):
                for d in deltas:
                    if wid and d.request_id in self._routes and self.holders.holder(d.request_id) != wid:
                        self._hold(d.request_id, wid, replace=True)
                    self._route(d.request_id, d)
            case RequestError(request_id=rid):
                self._route(rid, msg)

    def _route(self, request_id: str, item: StreamItem) -> None:
        route = self._routes.get(request_id)
        if route is None:
            self.dropped_deltas += 1
            return
        route.queue.put_nowait((route.tag, item))

    async def submit(self, msg: Submit, timeout: float) -> None:
        """Ask a scheduler to admit the request; ApiError with its code when refused or unanswered.

        A Submit that got no answer may still have been admitted, so it is cancelled (cheap, idempotent)."""
        local = self.local
        try:
            if local is not None and local.taking_work():
                reply: SubmitReply = await local.submit(msg, timeout)
            else:
                reply = await self.bus.request(subjects.SCHED_SUBMIT, msg, SubmitReply, timeout=timeout)
        except NoResponders:
            raise ApiError(503, "no scheduler is running", code="unavailable") from None
        except RequestTimeout:
            self.close(msg.request_id, "no scheduler reply")
            raise ApiError(503, f"no scheduler answered within {timeout:g}s", code="unavailable") from None
        except RequestRejected as e:
            raise mesh_error(e.code, e.message) from None
        except BusError as e:
            self.close(msg.request_id, "bus error")
            raise ApiError(503, f"cannot reach the scheduler: {e}", code="unavailable") from None
        if not reply.ok:
            raise mesh_error(reply.code, reply.message or "the scheduler refused the request")
        if reply.scheduler_id and msg.request_id in self._routes:
            self._hold(msg.request_id, reply.scheduler_id, replace=False)

    def _hold(self, request_id: str, node: str, replace: bool) -> None:
        (self.holders.set if replace else self.holders.setdefault)(request_id, node)
        self.liveness.watch(node)

    async def _on_dead(self, nodes: list[str]) -> None:
        for node in nodes:
            for rid in self.holders.items_of(node):
                self.holders.drop(rid)
                msg = f"{node} stopped answering"
                self._route(rid, RequestError(request_id=rid, code=503, message=msg, worker_id=node))

    async def _on_reconnect(self) -> None:
        for rid in list(self._routes):
            msg = "the bus connection was lost; tokens may be missing"
            self._route(rid, RequestError(request_id=rid, code=503, message=msg))

    def close(self, request_id: str, reason: str | None = None) -> None:
        """Forget the request; with a reason, also tell the mesh to drop it (Cancel, from a task of its own).
        Synchronous: it runs in `finally` blocks of cancelled tasks, where an await would be cancelled too."""
        self._routes.pop(request_id, None)
        self.holders.drop(request_id)
        if reason is None:
            return
        task = asyncio.get_running_loop().create_task(self._publish_cancel(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.bus.publish(subjects.CANCEL, Cancel(request_id=request_id, reason=reason))
        except Exception as e:  # the connection may be gone; leases on the workers cover it
            log.warning("could not publish Cancel for %s: %s", request_id, e)

    async def wait_background(self, timeout: float = 5.0) -> None:
        """Let pending Cancel publishes go out (shutdown, tests)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)
