import asyncio

import nats
import pytest

from libs.launch.mesh import Mesh, MeshConfig
from libs.launch.natsauth import NatsAuth


async def _kv(mesh: Mesh, put: bytes | None) -> bytes:
    nc = await nats.connect(
        mesh.nats_url, connect_timeout=2, max_reconnect_attempts=0, **mesh.connect_options()
    )
    try:
        kv = await nc.jetstream().create_key_value(bucket="mesh_t")
        if put is not None:
            await kv.put("k", put)
        return (await kv.get("k")).value
    finally:
        await nc.close()


def test_nats_store_and_auth_file_outlive_a_crash_but_not_stop(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    auth = NatsAuth(user="mesh", password="s3cret")
    mesh = Mesh(MeshConfig(model_dir=tmp_path, log_dir=logs, nats_auth=auth))

    async def ready(timeout: float) -> None:
        return None

    monkeypatch.setattr(mesh, "specs", list)  # only the nats-server: no services to start
    monkeypatch.setattr(mesh, "_wait_ready", ready)
    mesh.start()
    nats_dir = mesh._nats_dir
    try:
        assert asyncio.run(_kv(mesh, b"kept")) == b"kept"
        mesh.restart_nats()  # SIGKILL: the supervisor starts it again, same port, same store
        assert mesh.sup.restarts("nats-server") == 1
        assert asyncio.run(_kv(mesh, None)) == b"kept"
    finally:
        mesh.stop()
    assert nats_dir is not None and not nats_dir.exists()
    # the password file and the JetStream store were private to this mesh: nothing left in a reusable log dir
    leftovers = [p.name for p in logs.rglob("*")]
    assert "nats-auth.conf" not in leftovers and not any("store" in n for n in leftovers)
    assert not any("s3cret" in p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file())


def test_a_restart_never_reads_the_previous_lifes_ports(tmp_path):
    from libs.bus.ports import read_ports, write_ports
    from libs.launch.supervisor import ServiceSpec, Supervisor

    ports = tmp_path / "ports" / "svc.json"
    write_ports(ports, {"http": 1})  # left by a process that was killed
    sup = Supervisor(tmp_path / "logs")
    sup.start(ServiceSpec("svc", "sysconfig", ports_file=ports))  # a module that exits at once
    assert read_ports(ports) is None
    sup.stop_all()


def _specs(tmp_path, gateways: int, port: int = 0) -> dict:
    from types import SimpleNamespace

    mesh = Mesh(MeshConfig(model_dir=tmp_path, log_dir=tmp_path / "logs", port=port, gateways=gateways))
    mesh.nats = SimpleNamespace(url="nats://127.0.0.1:1")  # type: ignore[assignment]  # specs only read its url
    return {s.name: s for s in mesh.specs() if s.module == "services.gateway"}


def test_one_gateway_keeps_its_name_and_api_port_only(tmp_path):
    (gw,) = _specs(tmp_path, 1).values()
    assert gw.name == "gateway" and gw.env["MOEMESH_GATEWAY_PORT"] == "0"
    assert "MOEMESH_GATEWAY_REUSE_PORT" not in gw.env and "MOEMESH_GATEWAY_HTTP_PORT" not in gw.env


def test_gateway_replicas_share_the_api_port_and_each_has_a_side_port(tmp_path):
    specs = _specs(tmp_path, 3, port=8123)
    assert list(specs) == ["gateway-0", "gateway-1", "gateway-2"]
    for name, s in specs.items():
        assert s.env["MOEMESH_GATEWAY_PORT"] == "8123" and s.env["MOEMESH_GATEWAY_REUSE_PORT"] == "true"
        assert s.env["MOEMESH_GATEWAY_HTTP_PORT"] == "-1"  # /metrics and /ready of this replica alone
        assert "MOEMESH_GATEWAY_INSTANCE_ID" not in s.env  # random per process: never a dead one's stream
        assert s.ports_file == tmp_path / "logs" / "ports" / f"{name}.json"
    with pytest.raises(ValueError, match="gateway-0"):
        Mesh(MeshConfig(model_dir=tmp_path, log_dir=tmp_path / "l2", gateways=2)).metrics_url("gateway")
