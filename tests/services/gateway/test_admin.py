"""The gateway's admin endpoints: the worker directory (pure), and the routes against a real nats-server
with a stand-in decode worker that answers admin requests and sends heartbeats."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from libs.bus import Bus
from proto import messages as m
from proto import subjects
from services.gateway.admin import WorkerDirectory
from tests.services.gateway.conftest import StartGateway, base_url


def beat(wid: str, role: m.Role = m.Role.DECODE, interval_ms: int = 100) -> m.WorkerHeartbeat:
    return m.WorkerHeartbeat(
        worker_id=wid, role=role, model="x", running=0, waiting=0, free_pages=1, total_pages=1, page_size=16,
        max_context=128, interval_ms=interval_ms, sent_ms=int(time.time() * 1000),
    )  # fmt: skip


def test_directory_keeps_workers_heard_within_three_intervals() -> None:
    d = WorkerDirectory()
    d.observe(beat("d1"), now=10.0)
    d.observe(beat("p1", m.Role.PREFILL, interval_ms=1000), now=10.0)
    assert d.live(10.29) == [("d1", m.Role.DECODE), ("p1", m.Role.PREFILL)]
    assert d.live(10.29, m.Role.DECODE) == [("d1", m.Role.DECODE)]
    assert d.live(10.31) == [("p1", m.Role.PREFILL)]  # d1 missed three 100 ms beats
    d.observe(beat("d1"), now=10.5)
    d.observe(m.WorkerGone(worker_id="p1", role=m.Role.PREFILL), now=10.5)
    assert d.live(10.5) == [("d1", m.Role.DECODE)]


class StandInDecode:
    """A decode worker's admin side: answers GetStats / SetSlowdown like services.decode_worker."""

    def __init__(self, bus: Bus) -> None:
        self.bus, self.id, self.sleep_ms = bus, f"dec-{uuid.uuid4().hex[:6]}", 0.0

    async def start(self) -> None:
        await self.bus.subscribe(subjects.admin("decode-worker", self.id), m.AdminRequest, self.on_admin)
        await self.bus.flush()
        await self.bus.publish(subjects.heartbeat("decode"), beat(self.id, interval_ms=60_000))

    async def on_admin(self, msg: m.AdminRequest) -> m.AdminReply:
        if isinstance(msg, m.SetSlowdown):
            self.sleep_ms = msg.forward_sleep_ms
        stats = m.WorkerStats(
            worker_id=self.id, role=m.Role.DECODE, running=3, waiting=1, free_pages=7, total_pages=9,
            reserved_handles=0, forward_sleep_ms=self.sleep_ms,
        )  # fmt: skip
        return m.AdminReply(ok=True, stats=stats)


@pytest.fixture
async def decode(nats_server: str) -> AsyncIterator[StandInDecode]:
    bus = await Bus.connect(nats_server, "stand-in-decode")
    worker = StandInDecode(bus)
    yield worker
    await bus.close()


def mine(reply: dict, worker: StandInDecode) -> dict:
    (stats,) = [w for w in reply["workers"] if w["worker_id"] == worker.id]
    return stats


async def test_admin_routes_do_not_exist_unless_enabled(start_gateway: StartGateway) -> None:
    url = base_url(await start_gateway())
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:
        assert (await h.get("/admin/workers")).status_code == 404
        assert (await h.post("/admin/slowdown", json={"forward_sleep_ms": 5})).status_code == 404


async def test_slowdown_fans_out_to_decode_workers_behind_the_api_key(
    start_gateway: StartGateway, decode: StandInDecode
) -> None:
    url = base_url(await start_gateway(enable_admin=True, api_key="sekret"))
    await decode.start()
    auth = {"Authorization": "Bearer sekret"}
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:
        assert (await h.get("/admin/workers")).status_code == 401
        assert (await h.post("/admin/slowdown", json={"forward_sleep_ms": 5})).status_code == 401
        assert decode.sleep_ms == 0.0

        stats = mine((await h.get("/admin/workers", headers=auth)).json(), decode)
        assert stats | {"worker_id": "?"} == {
            "worker_id": "?", "role": "decode", "running": 3, "waiting": 1, "free_pages": 7, "total_pages": 9,
            "reserved_handles": 0, "forward_sleep_ms": 0.0,
            "used_pages": 0, "cached_pages": 0, "request_pages": 0, "live_requests": 0,
        }  # fmt: skip

        r = await h.post("/admin/slowdown", json={"forward_sleep_ms": 250}, headers=auth)
        assert r.status_code == 200 and mine(r.json(), decode)["forward_sleep_ms"] == 250.0
        assert decode.sleep_ms == 250.0
        r = await h.post("/admin/slowdown", json={"forward_sleep_ms": 0}, headers=auth)
        assert r.status_code == 200 and decode.sleep_ms == 0.0


@pytest.mark.parametrize(
    ("body", "param"),
    [({"forward_sleep_ms": -1}, "forward_sleep_ms"), ({"forward_sleep_ms": 1e9}, "forward_sleep_ms"),
     ({"sleep": 5}, "forward_sleep_ms"), ("nope", "body")],
)  # fmt: skip
async def test_bad_slowdown_bodies_are_400(start_gateway: StartGateway, body: object, param: str) -> None:
    url = base_url(await start_gateway(enable_admin=True))
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:
        kw = {"content": body} if isinstance(body, str) else {"json": body}
        r = await h.post("/admin/slowdown", **kw)  # type: ignore[arg-type]
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


async def test_the_gateway_receives_each_heartbeat_once(
    start_gateway: StartGateway, nats_server: str
) -> None:
    """Migration liveness, /ready and the admin directory share one subscription per heartbeat subject:
    each heartbeat is delivered to the gateway once, not once per user."""
    gw = await start_gateway(enable_admin=True)
    assert gw.mesh is not None and gw.admin is not None
    bus = await Bus.connect(nats_server, "workers")
    try:
        before = gw.bus.nc.stats["in_msgs"]
        for i in range(10):
            hb = msgspec.structs.replace(beat(f"p{i}", m.Role.PREFILL, 60_000), model=gw.info.name)
            await bus.publish(subjects.heartbeat("prefill"), hb)
        await bus.publish(
            subjects.SCHED_HEARTBEAT, m.SchedulerHeartbeat(scheduler_id="s0", interval_ms=60_000, sent_ms=0)
        )
        hb = msgspec.structs.replace(beat("d0", interval_ms=60_000), model=gw.info.name)
        await bus.publish(subjects.heartbeat("decode"), hb)  # sent last
        await bus.flush()
        async with asyncio.timeout(10):
            while "d0" not in gw.mesh.liveness.table:
                await asyncio.sleep(0.005)
        assert gw.bus.nc.stats["in_msgs"] - before == 12
        ready = gw.readiness.check()
        assert ready.reason is None and (ready.decode_workers, ready.prefill_workers, ready.schedulers) == (
            1,
            10,
            1,
        )
        assert len(await gw.admin.workers(None)) == 11
        assert "s0" in gw.mesh.liveness.table and "p0" not in gw.mesh.liveness.table  # prefill: not a holder
    finally:
        await bus.close()
