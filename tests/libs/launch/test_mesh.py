import asyncio

import nats

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
