"""The real mesh for e2e tests: nats-server, kv-broker, scheduler, prefill + decode workers and gateway as
separate processes on loopback, with real Mooncake TCP between the workers, serving a tiny checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig

# Prompts longer than this go prefill -> Mooncake -> decode; shorter ones are prefilled on the decode worker.
DIRECT_THRESHOLD = 8


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model,
        port=0,
        log_dir=tmp_path_factory.mktemp("mesh-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
        },
    )
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def assert_no_leaks(mesh: Mesh, timeout: float = 35.0) -> None:
    """After a module's traffic: every worker holds no request pages and no live request (the prefix
    cache's pages aside); a reservation may take up to its lease to come back."""
    import asyncio

    from libs.chaos import wait_for_no_leaks
    from proto.messages import Role

    workers = [(r, w) for r in (Role.PREFILL, Role.DECODE) for w in mesh.worker_ids(r)]
    left = asyncio.run(wait_for_no_leaks(mesh.nats_url, workers, timeout, mesh.connect_options()))
    assert all(v == 0 for v in left.values()), f"request pages / live requests left after the tests: {left}"


def workers_env(settings: dict[str, str]) -> dict[str, dict[str, str]]:
    """MeshConfig.extra_env entries giving the prefill and the decode workers the same settings."""
    return {
        "services.prefill_worker": {f"MOEMESH_PREFILL_WORKER_{k}": v for k, v in settings.items()},
        "services.decode_worker": {f"MOEMESH_DECODE_WORKER_{k}": v for k, v in settings.items()},
    }
