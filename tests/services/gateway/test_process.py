"""The gateway as its own process: no torch, settings from env/flags, `python -m services.gateway`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from libs.bus import SettingsError, load_settings
from libs.bus.ports import read_ports
from services.gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parents[3]


def test_importing_the_gateway_does_not_import_torch() -> None:
    code = (
        "import sys, services.gateway.service, services.gateway.app, services.gateway.__init__\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_settings_from_env_and_flags(model_dir: Path) -> None:
    env = {
        "MOEMESH_GATEWAY_MODEL_DIR": str(model_dir),
        "MOEMESH_GATEWAY_PORT": "9001",
        "MOEMESH_GATEWAY_API_KEY": "k",
        "MOEMESH_NATS_URL": "nats://10.0.0.1:4222",
        "MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": "30",
    }
    s = load_settings(GatewaySettings, "gateway", ["--port", "9002", "--served-model-name", "ds"], env=env)
    assert (s.port, s.api_key, s.nats_url, s.request_timeout_s, s.model_name) == (
        9002,
        "k",
        "nats://10.0.0.1:4222",
        30.0,
        "ds",
    )
    assert (
        load_settings(
            GatewaySettings, "gateway", env={"MOEMESH_GATEWAY_MODEL_DIR": str(model_dir)}
        ).model_name
        == model_dir.name
    )
    with pytest.raises(SettingsError, match="MOEMESH_GATEWAY_APIKEY"):
        load_settings(GatewaySettings, "gateway", env={**env, "MOEMESH_GATEWAY_APIKEY": "typo"})
    with pytest.raises(SettingsError, match="model_dir is required"):
        load_settings(GatewaySettings, "gateway", env={})
    with pytest.raises(SettingsError, match="request_timeout_s"):
        load_settings(GatewaySettings, "gateway", env={**env, "MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": "0"})


def test_runs_alone_and_stops_on_sigterm(nats_server: str, model_dir: Path, tmp_path: Path) -> None:
    ports_file = tmp_path / "ports" / "gateway.json"
    env = {
        **os.environ,
        "MOEMESH_NATS_URL": nats_server,
        "MOEMESH_GATEWAY_MODEL_DIR": str(model_dir),
        "MOEMESH_GATEWAY_PORT": "0",  # any free port: the gateway binds it and says which in its ports file
        "MOEMESH_GATEWAY_PORTS_FILE": str(ports_file),
    }
    log = (tmp_path / "gateway.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway"], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 20
        while (ports := read_ports(ports_file)) is None:
            assert proc.poll() is None, "gateway exited: " + (tmp_path / "gateway.log").read_text()
            assert time.monotonic() < deadline, "gateway wrote no ports file in 20 s"
            time.sleep(0.05)
        port = ports["api"]
        assert set(ports) == {"api"}  # no side port: the API port serves /health and /metrics
        while True:
            assert proc.poll() is None, "gateway exited: " + (tmp_path / "gateway.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway not healthy in 20 s"
            time.sleep(0.05)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [model_dir.name]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "draining" in (tmp_path / "gateway.log").read_text()


def test_reuse_port_lets_replicas_bind_one_port_and_only_then() -> None:
    from services.gateway.service import _bind

    first = _bind("127.0.0.1", 0, reuse_port=True)
    first.listen()  # uvicorn listens; a bound socket that does not conflicts with less
    port = first.getsockname()[1]
    try:
        second = _bind("127.0.0.1", port, reuse_port=True)  # a second replica on the same port
        second.listen()
        assert second.getsockname()[1] == port
        second.close()
        with pytest.raises(OSError):  # a gateway without reuse_port still refuses a taken port
            _bind("127.0.0.1", port)
    finally:
        first.close()


def test_refuses_to_start_without_a_model_dir() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEMESH_")}
    r = subprocess.run(
        [sys.executable, "-m", "services.gateway"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "model_dir is required" in r.stderr
