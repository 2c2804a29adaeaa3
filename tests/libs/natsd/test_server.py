import os
import signal
import subprocess
import sys

import nats
import pytest

from libs.natsd import NatsServerError, find_nats_server_binary, start_nats_server


async def _kv_roundtrip(url: str, bucket: str, put: bytes | None) -> bytes:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=bucket)
        if put is not None:
            await kv.put("k", put)
        return (await kv.get("k")).value
    finally:
        await nc.close()


def test_binary_is_found():
    assert os.access(find_nats_server_binary(), os.X_OK)


def test_bad_binary_override_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MOEMESH_NATS_SERVER_BIN", "/nonexistent/nats-server")
    with pytest.raises(NatsServerError, match="MOEMESH_NATS_SERVER_BIN"):
        find_nats_server_binary()


async def test_free_port_jetstream_and_stop_cleans_up():
    with start_nats_server() as server:
        assert server.port > 0 and server.url.startswith("nats://127.0.0.1:")
        assert await _kv_roundtrip(server.url, "natsd_t1", b"v") == b"v"
        workdir = server._workdir
        assert os.path.isdir(workdir)
    assert not server.is_running()
    assert not os.path.exists(workdir)


async def test_store_dir_survives_restart_on_same_port(tmp_path):
    store = str(tmp_path / "js")
    with start_nats_server(store_dir=store) as first:
        port = first.port
        await _kv_roundtrip(first.url, "natsd_t2", b"kept")
    with start_nats_server(port=port, store_dir=store) as second:
        assert second.port == port
        assert await _kv_roundtrip(second.url, "natsd_t2", None) == b"kept"


def test_port_in_use_raises_with_server_log():
    with start_nats_server(jetstream=False) as server:
        with pytest.raises(NatsServerError, match="exited with code") as e:
            start_nats_server(port=server.port, jetstream=False)
        assert "address already in use" in str(e.value).lower()


def test_bad_port_is_value_error():
    with pytest.raises(ValueError, match="port"):
        start_nats_server(port=70000)


def test_module_runs_in_foreground_and_stops_on_sigint():
    proc = subprocess.Popen(
        [sys.executable, "-m", "libs.natsd", "--port", "0", "--no-jetstream"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "nats-server ready at nats://127.0.0.1:" in line, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # longer than the server stop's own 10 s SIGTERM grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
