"""`moemesh serve`, the containers' entry point, and the OTEL_* environment reaching services started by
`moemesh up` (libs.launch's Supervisor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.cli.main import main
from libs.cli.serve import config_file, container_env, instance_id_of, section_keys
from libs.launch.supervisor import ServiceSpec, Supervisor
from tests.deploy.checks import check_settings


def test_instance_id_comes_from_the_hostname_as_a_subject_token() -> None:
    assert instance_id_of("decode-worker-0") == "decode-worker-0"
    assert instance_id_of("node1.example.com") == "node1-example-com"
    with pytest.raises(ValueError, match="hostname"):
        instance_id_of("...")


def test_container_env_fills_in_what_the_environment_leaves_unset() -> None:
    env = container_env("decode-worker", {}, "decode-worker-1", "10.0.0.7")
    assert env == {
        "MOEMESH_DECODE_WORKER_INSTANCE_ID": "decode-worker-1",
        "MOEMESH_DECODE_WORKER_TRANSFER_HOSTNAME": "10.0.0.7",
    }
    settings = check_settings("decode-worker", {**env, "MOEMESH_DECODE_WORKER_MODEL_DIR": "/m"})
    assert (settings.instance_id, settings.transfer_hostname) == ("decode-worker-1", "10.0.0.7")
    given = {"MOEMESH_DECODE_WORKER_INSTANCE_ID": "d0", "MOEMESH_DECODE_WORKER_TRANSFER_HOSTNAME": "h"}
    assert container_env("decode-worker", given, "x", "10.0.0.7") == {}
    assert container_env("gateway", {}, "gw-abc", "10.0.0.8") == {"MOEMESH_GATEWAY_INSTANCE_ID": "gw-abc"}
    with pytest.raises(ValueError, match="unknown service"):
        container_env("router", {}, "x", None)


def test_a_config_file_section_beats_what_serve_would_add(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("MOEMESH_DECODE_WORKER_INSTANCE_ID", raising=False)
    cfg = tmp_path / "moemesh.yaml"
    cfg.write_text("max_num_seqs: 8\ndecode-worker:\n  instance_id: d7\n")
    assert (
        config_file(["--config", str(cfg)], {}) == config_file([], {"MOEMESH_CONFIG": str(cfg)}) == str(cfg)
    )
    keys = section_keys("decode-worker", str(cfg))
    assert container_env("decode-worker", {}, "host", "10.0.0.7", keys) == {
        "MOEMESH_DECODE_WORKER_TRANSFER_HOSTNAME": "10.0.0.7"
    }
    assert main(["serve", "--dry-run", "decode-worker", "--config", str(cfg), "--max-num-seqs", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("MOEMESH_DECODE_WORKER_INSTANCE_ID=") for line in out)
    assert out[-1].endswith(f"-m services.decode_worker --config {cfg} --max-num-seqs 5")


def test_dry_run_prints_the_service_command(capsys, monkeypatch) -> None:
    monkeypatch.delenv("MOEMESH_KV_BROKER_INSTANCE_ID", raising=False)
    assert main(["serve", "--dry-run", "kv-broker", "--http-port", "9090"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("MOEMESH_KV_BROKER_INSTANCE_ID=")
    assert out[-1].endswith("-m services.kv_broker --http-port 9090")


def test_services_started_by_the_supervisor_see_the_otel_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.test:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    sup = Supervisor(tmp_path)
    proc = sup.start(
        ServiceSpec("probe", "libs.telemetry", {"MOEMESH_NATS_URL": "nats://x:1"}, ("scheduler",))
    )
    assert proc.proc.wait(30) == 0  # the child wrote its log before it exited
    assert proc.log_tail().strip() == "scheduler: otlp grpc http://collector.test:4317"
