"""Admin endpoints of the gateway: worker stats and the decode slow-down control."""

# - `GET /admin/workers`: `GetStats` to every live worker, `{"workers": [stats...], "errors": [...]}`.
# - `POST /admin/slowdown {"forward_sleep_ms": x}`: `SetSlowdown` to every live decode worker (0 turns
#   it off), answered with their stats after the change. This holds back decode so KV piles up and a full
#   batch builds (the method behind SGLang's PD + large-scale EP decode numbers); it stalls every user of
#   the mesh, hence the guards: off unless `enable_admin` is set (the routes do not exist otherwise), and
#   the API key required when one is set.
#
# Workers are learned from their heartbeats (`proto.subjects.HEARTBEAT_ALL`): one heard within
# `DEAD_AFTER_INTERVALS` of its own interval is live; `WorkerGone` forgets it at once. The directory is
# pure (`WorkerDirectory`); `AdminMesh` is its bus side.

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from libs.bus.bus import Bus, BusError
from proto import messages as m
from proto import subjects
from services.gateway.errors import ApiError

DEAD_AFTER_INTERVALS = 3
MAX_SLOWDOWN_MS = 60_000.0
SERVICE_OF_ROLE = {m.Role.DECODE: "decode-worker", m.Role.PREFILL: "prefill-worker"}


@dataclass(frozen=True)
class _Seen:
    role: m.Role
    at: float
    interval_s: float


class WorkerDirectory:
    """Live workers by id, from heartbeats (pure: the caller passes the time)."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def observe(self, msg: m.WorkerHeartbeat | m.WorkerGone, now: float) -> None:
        match msg:
            case m.WorkerHeartbeat(worker_id=wid, role=role, interval_ms=ms):
                self._seen[wid] = _Seen(role, now, ms / 1000)
            case m.WorkerGone(worker_id=wid):
                self._seen.pop(wid, None)

    def live(self, now: float, role: m.Role | None = None) -> list[tuple[str, m.Role]]:
        """(worker id, role) of the workers heard recently enough, sorted by id."""
        return sorted(
            (wid, s.role)
            for wid, s in self._seen.items()
            if now - s.at <= DEAD_AFTER_INTERVALS * s.interval_s and (role is None or s.role == role)
        )


class AdminMesh:
    """The gateway's admin side of the bus: the worker directory and fan-out requests."""

    def __init__(self, bus: Bus, timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.bus, self.timeout_s, self.clock = bus, timeout_s, clock
        self.directory = WorkerDirectory()
        self._heard = asyncio.Event()

    async def start(self, subscribe: bool = True) -> None:
        """subscribe False: the owner hands every worker heartbeat to `observe`."""
        if subscribe:
            await self.bus.subscribe(subjects.HEARTBEAT_ALL, m.Heartbeat, self.observe)

    async def observe(self, msg: m.WorkerHeartbeat | m.WorkerGone) -> None:
        self.directory.observe(msg, self.clock())
        self._heard.set()

    async def workers(self, role: m.Role | None) -> list[tuple[str, m.Role]]:
        """Live workers; a gateway that has heard no heartbeat yet waits up to the timeout for one."""
        if not self._heard.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard.wait(), self.timeout_s)
        return self.directory.live(self.clock(), role)

    async def fan_out(self, msg: m.AdminRequest, role: m.Role | None) -> dict[str, Any]:
        """Send msg to each live worker (of `role`) at once; stats of those that answered, errors of the rest."""
        targets = await self.workers(role)
        if not targets:
            raise ApiError(503, "no live worker heard on the bus", code="unavailable")

        async def ask(wid: str, r: m.Role) -> m.AdminReply:
            subject = subjects.admin(SERVICE_OF_ROLE[r], wid)
            return await self.bus.request(subject, msg, m.AdminReply, timeout=self.timeout_s)

        replies = await asyncio.gather(*(ask(w, r) for w, r in targets), return_exceptions=True)
        stats, errors = [], []
        for (wid, _), reply in zip(targets, replies, strict=True):
            if isinstance(reply, BaseException):
                if not isinstance(reply, BusError):
                    raise reply
                errors.append({"worker_id": wid, "error": str(reply)})
            elif not reply.ok or reply.stats is None:
                errors.append({"worker_id": wid, "error": reply.message or "no stats in the reply"})
            else:
                stats.append(_stats_json(reply.stats))
        return {"workers": stats, "errors": errors}


def _stats_json(s: m.WorkerStats) -> dict[str, Any]:
    out = msgspec.to_builtins(s)
    out["role"] = s.role.name.lower()
    out.pop("requests", None)  # request ids: long and not what an operator polls for
    return out


class SlowdownBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    forward_sleep_ms: Annotated[float, Field(ge=0, le=MAX_SLOWDOWN_MS)]


def _authorize(api_key: str, request: Request) -> None:
    if not api_key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise ApiError(
            401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
        )


async def _slowdown_body(request: Request) -> SlowdownBody:
    try:
        return SlowdownBody.model_validate_json(await request.body())
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "body"
        raise ApiError(
            400, f"{where}: {err.get('msg', 'invalid')}", param=where, code="invalid_value"
        ) from None


def install_admin(app: FastAPI, admin: AdminMesh, api_key: str) -> None:
    """Add the admin routes to the gateway's app (only called when admin is enabled)."""

    @app.get("/admin/workers")
    async def workers(request: Request) -> Response:
        _authorize(api_key, request)
        return JSONResponse(await admin.fan_out(m.GetStats(), None))

    @app.post("/admin/slowdown")
    async def slowdown(request: Request) -> Response:
        _authorize(api_key, request)
        body = await _slowdown_body(request)
        return JSONResponse(
            await admin.fan_out(m.SetSlowdown(forward_sleep_ms=body.forward_sleep_ms), m.Role.DECODE)
        )
