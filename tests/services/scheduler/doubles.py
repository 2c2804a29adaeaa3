"""In-test doubles of a decode and a prefill worker: they send heartbeats and record what they receive."""

from __future__ import annotations

import asyncio
import itertools

from libs.bus import Bus, current_traceparent
from proto import messages as m
from proto import subjects
from tests.services.scheduler.factories import make_heartbeat

_handles = itertools.count()


class FakeDecode:
    """Answers ReserveKv (ok, or refused while `refuse` is set) and records DecodeDirect."""

    def __init__(self, bus: Bus, worker_id: str, model: str, *, refuse: bool = False) -> None:
        self.bus, self.worker_id, self.model, self.refuse = bus, worker_id, model, refuse
        self.reserves: asyncio.Queue[m.ReserveKv] = asyncio.Queue()
        self.directs: asyncio.Queue[m.DecodeDirect] = asyncio.Queue()
        self.handles: dict[str, m.KvHandle] = {}

    async def start(self, **heartbeat: object) -> FakeDecode:
        await self.bus.subscribe(subjects.decode_inbox(self.worker_id), m.DecodeInbox, self._on_msg)
        await self.heartbeat(**heartbeat)
        return self

    async def heartbeat(self, **kw: object) -> None:
        kw.setdefault("interval_ms", 60_000)
        hb = make_heartbeat(self.worker_id, m.Role.DECODE, model=self.model, **kw)  # type: ignore[arg-type]
        await self.bus.publish(subjects.heartbeat_of(hb), hb)

    async def _on_msg(self, msg: m.DecodeInbox) -> m.ReserveKvReply | None:
        match msg:
            case m.ReserveKv():
                await self.reserves.put(msg)
                if self.refuse:
                    return m.ReserveKvReply(
                        request_id=msg.request_id, ok=False, code=503, message="no free pages"
                    )
                handle = m.KvHandle(
                    handle_id=f"h{next(_handles)}", request_id=msg.request_id, decode_worker=self.worker_id,
                    session_id="127.0.0.1:1", page_ids=[0, 1], num_tokens=msg.num_tokens, lease_expires_ms=0,
                )  # fmt: skip
                self.handles[msg.request_id] = handle
                return m.ReserveKvReply(request_id=msg.request_id, ok=True, handle=handle)
            case m.DecodeDirect():
                await self.directs.put(msg)
        return None


class FakePrefill:
    """Records PrefillTasks with the traceparent they arrived under (`tasks`), and every message of its
    inbox in order (`inbox`: with overlap_prefill, the PrefillStart / PrefillAbandon around them)."""

    def __init__(self, bus: Bus, worker_id: str, model: str) -> None:
        self.bus, self.worker_id, self.model = bus, worker_id, model
        self.tasks: asyncio.Queue[tuple[m.PrefillTask, str | None]] = asyncio.Queue()
        self.inbox: asyncio.Queue[m.PrefillInbox] = asyncio.Queue()

    async def start(self, **heartbeat: object) -> FakePrefill:
        await self.bus.subscribe(subjects.prefill_inbox(self.worker_id), m.PrefillInbox, self._on_task)
        kw = {"interval_ms": 60_000, **heartbeat}
        hb = make_heartbeat(self.worker_id, m.Role.PREFILL, model=self.model, **kw)  # type: ignore[arg-type]
        await self.bus.publish(subjects.heartbeat_of(hb), hb)
        return self

    async def _on_task(self, msg: m.PrefillInbox) -> None:
        await self.inbox.put(msg)
        if isinstance(msg, m.PrefillTask):
            await self.tasks.put((msg, current_traceparent()))
