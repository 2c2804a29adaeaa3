"""The gateway's embedded scheduler against a real nats-server: MeshClient's in-process submit gives the
outcomes of the bus path (admitted, refused, a handler error, no answer in time), reaches the host's own
replica while other submits spread over the queue group, falls back to the bus while it does not take
work; the gateway starts it with its own settings and connection, drains it, and stops when it ends."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from libs.bus import Bus
from proto import messages as m
from proto import subjects
from services.gateway.embedded_scheduler import EmbeddedScheduler, embedded_settings
from services.gateway.errors import ApiError
from services.gateway.mesh_client import MeshClient
from services.gateway.service import Gateway
from services.gateway.settings import GatewaySettings
from services.scheduler.service import SchedulerService, SchedulerSettings
from tests.service_helpers import start_service, stop_service
from tests.services.scheduler.doubles import FakeDecode

TIMEOUT = 5.0


class Mesh:
    """One model with a decode-worker double, scheduler replicas, and gateway-side MeshClients."""

    def __init__(self, bus: Bus, nats_url: str) -> None:
        self.bus, self.nats_url = bus, nats_url
        self.model = f"m-{uuid.uuid4().hex[:6]}"
        self.embedded: list[EmbeddedScheduler] = []
        self.plain: list[tuple[SchedulerService, asyncio.Task]] = []
        self.clients: list[MeshClient] = []

    def settings(self, name: str) -> SchedulerSettings:
        return SchedulerSettings(
            nats_url=self.nats_url, instance_id=f"{name}-{self.model}", drain_timeout_s=1.0
        )

    async def embed(self, name: str) -> EmbeddedScheduler:
        es = EmbeddedScheduler(self.settings(name), on_exit=lambda: None)
        await es.start()
        self.embedded.append(es)
        return es

    async def replica(self, name: str) -> SchedulerService:
        svc = SchedulerService(self.settings(name))
        self.plain.append((svc, await start_service(svc)))
        return svc

    async def client(self, local: EmbeddedScheduler | None = None) -> MeshClient:
        c = MeshClient(self.bus, f"gw-{uuid.uuid4().hex[:8]}", local=local)
        await c.start()
        self.clients.append(c)
        return c

    async def worker(self, schedulers: list[SchedulerService]) -> FakeDecode:
        w = await FakeDecode(self.bus, f"decode-{self.model}", self.model).start()
        async with asyncio.timeout(TIMEOUT):
            for svc in schedulers:
                while w.worker_id not in svc.workers:
                    await svc.next_change()
        return w

    def submit(self, c: MeshClient, rid: str, **kw: Any) -> m.Submit:
        fields: dict[str, Any] = dict(
            request_id=rid, model=self.model, prompt_ids=[5, 6, 7], sampling=m.Sampling(max_tokens=2),
            stream_subject=c.stream_subject,
        )  # fmt: skip
        fields.update(kw)
        return m.Submit(**fields)

    async def stop(self) -> None:
        for c in self.clients:
            await c.wait_background()
        for es in self.embedded:
            await es.stop()
        for svc, task in self.plain:
            await stop_service(svc, task)


@pytest.fixture
async def mesh(nats_server: str) -> AsyncIterator[Mesh]:
    bus = await Bus.connect(nats_server, "embedded-test")
    mesh = Mesh(bus, nats_server)
    yield mesh
    await mesh.stop()
    await bus.close()


def received(svc: SchedulerService) -> float:
    return svc.registry.get_sample_value("moemesh_scheduler_requests_received_total") or 0.0


async def outcome(c: MeshClient, msg: m.Submit, timeout: float = TIMEOUT) -> tuple:
    """What submit did: admitted, or the ApiError's fields; the request's route is
    registered first, as Generation does, and whether it is still open is part of the outcome."""
    c.open(msg.request_id, asyncio.Queue(), 0)
    try:
        await c.submit(msg, timeout)
        result: tuple = ("admitted",)
    except ApiError as e:
        result = ("refused", e.status, e.code, e.message)
    still_open = msg.request_id in c._routes
    c.close(msg.request_id)
    return (*result, still_open)


async def test_in_process_submit_has_the_bus_paths_outcomes(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    es = await mesh.embed("sched")  # the only replica: the bus path reaches it too
    svc = es.service
    await mesh.worker([svc])
    over_bus, in_process = await mesh.client(), await mesh.client(local=es)

    async def both(make: Callable[[MeshClient], m.Submit], timeout: float = TIMEOUT) -> tuple:
        a = await outcome(over_bus, make(over_bus), timeout)
        b = await outcome(in_process, make(in_process), timeout)
        assert a == b
        return a

    n = iter(range(100))

    def rid() -> str:
        return f"r{next(n)}"

    assert await both(lambda c: mesh.submit(c, rid())) == ("admitted", True)
    assert received(svc) == 2
    refused = await both(lambda c: mesh.submit(c, rid(), model="no-such-model"))
    assert refused == ("refused", 503, "unavailable", "no live decode worker for model 'no-such-model'", True)
    bad = await both(lambda c: mesh.submit(c, rid(), stream_subject="not a subject"))
    assert bad[:3] == ("refused", 400, "invalid_value") and "invalid stream_subject" in bad[3]

    def boom(*_: object) -> None:
        raise RuntimeError("policy bug")

    monkeypatch.setattr(svc, "_decide", boom)
    assert await both(lambda c: mesh.submit(c, rid())) == (
        "refused", 500, "internal_error", "RuntimeError: policy bug", True,
    )  # fmt: skip

    never = asyncio.Event()

    async def stuck(_: m.Submit) -> dict[str, int]:
        await never.wait()
        return {}

    monkeypatch.setattr(svc, "prefix_hits", stuck)  # no answer in time: 503, the route closed (and cancelled)
    assert await both(lambda c: mesh.submit(c, rid()), timeout=0.2) == (
        "refused", 503, "unavailable", "no scheduler answered within 0.2s", False,
    )  # fmt: skip
    never.set()


async def test_in_process_and_bus_submits_are_handled_one_at_a_time(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bus hands a subscription's messages to its handler one at a time; submits that come in process
    must not interleave with those or each other at the handler's awaits (its placement decision reads the
    queue and the workers' load before it admits)."""
    es = await mesh.embed("sched")
    svc = es.service
    await mesh.worker([svc])
    over_bus, in_process = await mesh.client(), await mesh.client(local=es)
    inside, most = 0, 0
    real = svc.prefix_hits

    async def slow_hits(s: m.Submit) -> dict[str, int] | None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        try:
            for _ in range(5):  # yields to every other task, as a lookup over the bus would
                await asyncio.sleep(0)
            return await real(s)
        finally:
            inside -= 1

    monkeypatch.setattr(svc, "prefix_hits", slow_hits)
    msgs = [(c, mesh.submit(c, f"q{i}-{j}")) for i in range(4) for j, c in enumerate((over_bus, in_process))]
    got = await asyncio.gather(*(outcome(c, msg) for c, msg in msgs))
    assert all(g[0] == "admitted" for g in got), got
    assert most == 1


async def test_own_submits_reach_the_hosted_replica_and_fall_back_to_the_bus(mesh: Mesh) -> None:
    es = await mesh.embed("hosted")
    other = await mesh.replica("other")
    await mesh.worker([es.service, other])
    in_process, over_bus = await mesh.client(local=es), await mesh.client()

    async def taken(c: MeshClient, tag: str, k: int = 12) -> tuple[float, float]:
        """Submits each replica handled of k from this client."""
        before = received(es.service), received(other)
        got = [await outcome(c, mesh.submit(c, f"{tag}{i}")) for i in range(k)]
        assert got == [("admitted", True)] * k
        return received(es.service) - before[0], received(other) - before[1]

    assert await taken(in_process, "own") == (12, 0)
    hosted, elsewhere = await taken(over_bus, "bus")
    assert hosted > 0 and elsewhere > 0  # the queue group spreads them (all on one: p = 2**-11)
    await es.stop()  # draining: no longer takes work, so the host's submits go over the bus
    assert not es.taking_work()
    assert await taken(in_process, "after") == (0, 12)


def test_embedded_settings_are_the_schedulers_own_with_the_hosts_connection() -> None:
    gw = GatewaySettings(
        model_dir="/m", nats_url="nats://10.0.0.1:4333", nats_token="t0k", embedded_scheduler=True
    )
    env = {"MOEMESH_SCHEDULER_MAX_QUEUE": "3", "MOEMESH_SCHEDULER_NATS_URL": "nats://elsewhere:1"}
    s = embedded_settings(gw, "gateway-ab12", env)
    assert (s.max_queue, s.nats_url, s.nats_token, s.instance_id) == (
        3,
        gw.nats_url,
        "t0k",
        "scheduler-gateway-ab12",
    )
    named = embedded_settings(gw, "gateway-ab12", {"MOEMESH_SCHEDULER_INSTANCE_ID": "sched-7"})
    assert named.instance_id == "sched-7" and named.max_queue == SchedulerSettings().max_queue


@pytest.fixture
def gateway_settings(nats_server: str, model_dir: Path) -> Callable[..., GatewaySettings]:
    def make(**kw: Any) -> GatewaySettings:
        fields: dict[str, Any] = dict(
            nats_url=nats_server, model_dir=str(model_dir), port=0, instance_id=f"gw-{uuid.uuid4().hex[:8]}",
            drain_timeout_s=1.0,
        )  # fmt: skip
        return GatewaySettings(**{**fields, **kw})

    return make


async def test_the_gateway_hosts_its_scheduler_and_goes_down_with_it(
    gateway_settings: Callable[..., GatewaySettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOEMESH_SCHEDULER_MAX_QUEUE", "3")
    gw = Gateway(gateway_settings(embedded_scheduler=True))
    task = await start_service(gw)
    hosted = gw.scheduler
    assert hosted is not None and gw.mesh is not None and gw.mesh.local is hosted
    assert hosted.taking_work() and hosted.service.settings.max_queue == 3
    assert hosted.instance_id == f"scheduler-{gw.instance_id}"
    assert hosted.service.settings.nats_url == gw.settings.nats_url
    # a replica like any other: it answers SCHED_SUBMIT from other gateways
    probe = m.Submit(
        request_id="x1", model="none", prompt_ids=[1], sampling=m.Sampling(), stream_subject="s.x"
    )
    reply = await gw.bus.request(subjects.SCHED_SUBMIT, probe, m.SubmitReply, timeout=TIMEOUT)
    assert not reply.ok and reply.code == 503
    assert hosted.service.registry.get_sample_value("moemesh_scheduler_requests_received_total") == 1
    # the gateway's /metrics carries the hosted scheduler's families (each family once in the scrape)
    scrape = generate_latest(gw.registry).decode()
    assert "moemesh_scheduler_requests_received_total 1.0" in scrape
    assert scrape.count("# TYPE moemesh_service_ready ") == 1

    hosted.service.request_stop()  # it ends unasked: the gateway stops too (its supervisor restarts both)
    await asyncio.wait_for(task, TIMEOUT)


async def test_a_plain_gateway_hosts_nothing_and_a_stopping_one_drains_its_scheduler(
    gateway_settings: Callable[..., GatewaySettings],
) -> None:
    plain = Gateway(gateway_settings())
    plain_task = await start_service(plain)
    assert plain.scheduler is None and plain.mesh is not None and plain.mesh.local is None
    assert "moemesh_scheduler_" not in generate_latest(plain.registry).decode()
    await stop_service(plain, plain_task)
    gw = Gateway(gateway_settings(embedded_scheduler=True))
    task = await start_service(gw)
    assert gw.scheduler is not None
    await stop_service(gw, task)
    assert gw.scheduler.service.draining and gw.scheduler.service.bus.nc.is_closed
