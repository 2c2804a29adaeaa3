import asyncio
import inspect
import os
import signal
import uuid

import httpx
import msgspec
import pytest

from libs.bus import Bus, NoResponders, Service, ServiceSettings
from libs.bus.ports import read_ports, write_ports
from libs.natsd import start_nats_server
from tests.service_helpers import start_service, stop_service


class Ping(msgspec.Struct, frozen=True, tag=True):
    n: int


class Pong(msgspec.Struct, frozen=True, tag=True):
    n: int


class EchoService(Service):
    name = "echo"

    def __init__(self, settings, subject):
        super().__init__(settings)
        self.subject = subject
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.drained = False

    async def setup(self):
        await self.bus.subscribe(self.subject, Ping, self.handle, queue="echo", concurrent=True)

    async def handle(self, msg: Ping) -> Pong:
        if msg.n < 0:  # a slow request, to observe the graceful drain
            self.entered.set()
            await self.release.wait()
        return Pong(msg.n)

    async def on_drain(self):
        self.drained = True


async def wait_until(cond, timeout=10.0):
    """Wait for a condition owned by another party (the NATS client's reconnect loop); `cond` returns a
    bool or an awaitable of one."""
    async with asyncio.timeout(timeout):
        while True:
            ok = cond()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            await asyncio.sleep(0.02)


async def get(svc, path):
    async with httpx.AsyncClient() as c:
        return await c.get(f"http://127.0.0.1:{svc.http_port}{path}")


async def test_health_metrics_and_graceful_drain(nats_server):
    s = f"test.svc.{uuid.uuid4().hex}"
    svc = EchoService(ServiceSettings(nats_url=nats_server, http_port=-1, http_host="127.0.0.1"), s)
    task = await start_service(svc)
    client = await Bus.connect(nats_server, "client")
    try:
        assert (await get(svc, "/health")).status_code == 200
        assert await client.request(s, Ping(3), Pong, timeout=5) == Pong(3)
        metrics = (await get(svc, "/metrics")).text
        assert "moemesh_service_ready 1.0" in metrics
        assert f'moemesh_bus_messages_total{{outcome="ok",subscription="{s}"}} 1.0' in metrics
        # `name[]` filters, as prometheus_client's own server: only the series named, each of them
        only = (await get(svc, "/metrics?name[]=moemesh_service_ready&name[]=moemesh_bus_messages_total")).text
        series = {line.split("{")[0].split(" ")[0] for line in only.splitlines() if not line.startswith("#")}
        assert series == {"moemesh_service_ready", "moemesh_bus_messages_total"}
        assert f'moemesh_bus_messages_total{{outcome="ok",subscription="{s}"}} 1.0' in only
        assert (await get(svc, "/nope")).status_code == 404

        slow = asyncio.create_task(client.request(s, Ping(-1), Pong, timeout=10))
        await asyncio.wait_for(svc.entered.wait(), 5)
        svc.request_stop()
        await wait_until(lambda: svc.draining)
        health = await get(svc, "/health")  # still draining: the slow request holds it open
        assert health.status_code == 503 and health.json()["draining"] is True
        assert not task.done()
        svc.release.set()
        assert await asyncio.wait_for(slow, 10) == Pong(-1)  # in-flight work finished, reply delivered
        await asyncio.wait_for(task, 10)
        assert svc.drained
        with pytest.raises(NoResponders):
            await client.request(s, Ping(1), Pong, timeout=5)
    finally:
        await client.close()


async def test_ports_file_names_the_side_port_it_bound_before_started(nats_server, tmp_path):
    ports_file = tmp_path / "ports" / "echo.json"
    settings = ServiceSettings(
        nats_url=nats_server, http_port=-1, http_host="127.0.0.1", ports_file=str(ports_file)
    )
    svc = EchoService(settings, f"test.svc.{uuid.uuid4().hex}")
    task = await start_service(svc)
    try:
        ports = read_ports(ports_file)  # written before `started`: no wait needed
        assert ports == {"http": svc.http_port} and svc.http_port > 0
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"http://127.0.0.1:{ports['http']}/health")).status_code == 200
    finally:
        await stop_service(svc, task)
    assert list(ports_file.parent.iterdir()) == [ports_file]  # no temporary file left beside it


def test_ports_file_is_none_until_written_and_rejects_garbage(tmp_path):
    path = tmp_path / "x.json"
    assert read_ports(path) is None
    write_ports(path, {"http": 1234, "api": 80})
    assert read_ports(path) == {"http": 1234, "api": 80}
    path.write_text('{"http": "1234"}')
    with pytest.raises(ValueError, match="not a ports file"):
        read_ports(path)


async def test_sigterm_drains(nats_server):
    svc = EchoService(ServiceSettings(nats_url=nats_server), f"test.svc.{uuid.uuid4().hex}")
    task = await start_service(svc, install_signals=True)
    os.kill(os.getpid(), signal.SIGTERM)  # handled by the service's loop handler, removed on exit
    await asyncio.wait_for(task, 10)
    assert svc.drained and svc.http_port is None


async def test_health_follows_the_connection_through_a_nats_restart():
    server = start_nats_server(jetstream=False)
    port = server.port
    svc = EchoService(ServiceSettings(nats_url=server.url, http_port=-1, http_host="127.0.0.1"), "test.svc.r")
    task = await start_service(svc)
    try:

        async def status_is(code):
            return (await get(svc, "/health")).status_code == code

        assert await status_is(200)
        server.stop()
        await wait_until(lambda: status_is(503))
        server = start_nats_server(port=port, jetstream=False)
        await wait_until(lambda: status_is(200))
        client = await Bus.connect(server.url, "client")
        assert await client.request("test.svc.r", Ping(5), Pong, timeout=5) == Pong(5)
        await client.close()
    finally:
        svc.request_stop()
        await asyncio.wait_for(task, 10)
        server.stop()


def test_main_rejects_bad_settings(monkeypatch, capsys):
    monkeypatch.setenv("MOEMESH_ECHO_NO_SUCH_KEY", "1")
    assert EchoService.main([]) == 2
    assert "MOEMESH_ECHO_NO_SUCH_KEY" in capsys.readouterr().err


class SlowStart(Service):
    """Setup waits for the test, as a worker loading its model does; not ready until told."""

    name = "slow"

    def __init__(self, settings):
        super().__init__(settings)
        self.go = asyncio.Event()
        self.leave = asyncio.Event()  # on_drain waits for it, so the test sees the draining state
        self.usable = True

    async def setup(self):
        self.startup_stage = "loading the model"
        await self.go.wait()

    def not_ready_reason(self):
        return None if self.usable else "the KV pool is gone"

    async def on_drain(self):
        await self.leave.wait()


async def test_ready_says_why_not_until_setup_is_done_and_while_draining(nats_server):
    svc = SlowStart(ServiceSettings(nats_url=nats_server, http_port=-1, http_host="127.0.0.1"))
    task = asyncio.create_task(svc.run(install_signals=False))
    try:
        await wait_until(lambda: svc.http_port is not None)
        ready = await get(svc, "/ready")
        assert ready.status_code == 503
        err = ready.json()["error"]
        assert err == {"message": "slow is starting: loading the model", "type": "service_unavailable_error",
                       "param": None, "code": "not_ready"}  # fmt: skip
        assert (await get(svc, "/livez")).status_code == 200  # alive while it starts
        svc.go.set()
        await asyncio.wait_for(svc.started.wait(), 10)
        ready = await get(svc, "/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        svc.usable = False  # the subclass's own condition
        ready = await get(svc, "/ready")
        assert ready.status_code == 503 and ready.json()["error"]["message"] == "the KV pool is gone"
        svc.usable = True
        svc.request_stop()
        await wait_until(lambda: svc.draining)
        ready = await get(svc, "/ready")
        assert ready.status_code == 503 and ready.json()["error"]["message"] == "slow is draining"
    finally:
        svc.go.set()
        svc.leave.set()
        svc.request_stop()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("gc_freeze", [True, False])
async def test_a_service_in_its_own_process_freezes_its_start_up_heap_and_reports_gc_pauses(
    nats_server, gc_freeze, tmp_path, monkeypatch
):
    """main() marks the service as its process's own: once set up it freezes the start-up heap (unless
    gc_freeze is off), after writing its ports file (a worker heartbeats from set-up on, so a launcher may
    look for the file as soon as it hears one: a collection of a worker's heap can take a while); every
    service's collection pauses are on its /metrics."""
    import gc

    import libs.bus.service as service_module

    ports_file = tmp_path / "echo.json"
    ports_at_freeze = []
    real_freeze = service_module.freeze_startup_heap

    def freeze() -> int:
        ports_at_freeze.append(read_ports(ports_file))
        return real_freeze()

    monkeypatch.setattr(service_module, "freeze_startup_heap", freeze)
    settings = ServiceSettings(
        nats_url=nats_server,
        http_port=-1,
        http_host="127.0.0.1",
        gc_freeze=gc_freeze,
        ports_file=str(ports_file),
    )
    svc = EchoService(settings, f"test.svc.{uuid.uuid4().hex}")
    svc.freeze_heap_when_set_up = True
    gc.unfreeze()
    task = await start_service(svc)
    try:
        assert (gc.get_freeze_count() > 0) is gc_freeze
        assert ports_at_freeze == ([{"http": svc.http_port}] if gc_freeze else [])
        gc.collect()
        metrics = (await get(svc, "/metrics")).text
        assert 'moemesh_gc_pause_seconds_count{generation="2"}' in metrics
    finally:
        await stop_service(svc, task)
        gc.unfreeze()
    assert svc.gc_pauses not in gc.callbacks  # stopped: its callback is gone
