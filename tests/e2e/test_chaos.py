"""Chaos on the real mesh `moemesh up` runs (CPU, tiny model, every service supervised): one service is
SIGKILLed while greedy streams run; every request still finishes with the undisturbed text (none hangs or
errs), the supervisor has the service back (restart count 1), and no worker holds request pages after."""

# The mesh: 2 prefill + 2 decode workers, 2 scheduler replicas, the kv-broker, the gateway and a nats-server
# requiring a user/password. 24 streams of 48 tokens with ignore_eos, so none has finished when the fault
# strikes; the reference text is the in-process Engine's on the same checkpoint. The scenarios run in turn
# on one mesh.

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos import reference
from libs.chaos import FaultResult, metric_total, stream_many
from libs.chaos.scenarios import chaos_config, chaos_prompts, run_fault, standard_faults
from libs.launch.mesh import Mesh

pytestmark = pytest.mark.e2e

N_REQUESTS, MAX_TOKENS, DEADLINE_S, LEASE_MS = 24, 48, 90.0, 4000
PASSWORD = "chaos-nats-pw-8c1f"
PROMPTS = chaos_prompts(N_REQUESTS)


@pytest.fixture(scope="module")
def chaos_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = chaos_config(
        tiny_model, tmp_path_factory.mktemp("chaos-logs"), password=PASSWORD, lease_ms=LEASE_MS,
        deadline_s=DEADLINE_S,
    )  # fmt: skip
    with Mesh(cfg) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> list[list[int]]:
    return reference(tiny_model, PROMPTS, MAX_TOKENS)


FAULTS = {f.killed: f for f in standard_faults(N_REQUESTS)}


def run(mesh: Mesh, want: list[list[int]], killed: str) -> FaultResult:
    """One standard fault (libs.chaos.scenarios) while every prompt streams, with the checks every
    scenario shares."""
    result, left = run_fault(
        mesh, FAULTS[killed], PROMPTS, want, MAX_TOKENS, deadline_s=DEADLINE_S,
        leak_timeout_s=LEASE_MS / 1000 + 10,
    )  # fmt: skip
    print(result)  # the table row, with -s
    assert all(v == 0 for v in left.values()), f"pages or requests left on workers: {left}"
    assert result.finished_before_strike == 0, result  # it struck while every stream was running
    assert result.hung == 0 and result.wrong == 0 and result.errors == 0, result
    assert result.completed == N_REQUESTS, result
    assert result.restarts == 1 and mesh.sup.state(killed).value == "up", result
    return result


def launcher_restarts(mesh: Mesh, service: str, want: int, timeout: float = 10.0) -> float:
    """The gateway's view of the launcher (moemesh_launcher_service_restarts), once it reached `want`."""
    name = f'moemesh_launcher_service_restarts{{launcher="{mesh.launcher_id}",service="{service}"}}'
    deadline = time.monotonic() + timeout
    while (got := metric_total(mesh.url + "/metrics", name)) < want and time.monotonic() < deadline:
        time.sleep(0.2)  # the launcher publishes its status every second
    return got


def test_kill_a_decode_worker_mid_stream_migrates_its_requests(
    chaos_mesh: Mesh, want: list[list[int]]
) -> None:
    r = run(chaos_mesh, want, "decode-0")
    assert r.migrated >= 1, r
    assert launcher_restarts(chaos_mesh, "decode-0", 1) == 1


def test_kill_a_prefill_worker(chaos_mesh: Mesh, want: list[list[int]]) -> None:
    run(chaos_mesh, want, "prefill-1")


def test_kill_a_scheduler_replica(chaos_mesh: Mesh, want: list[list[int]]) -> None:
    r = run(chaos_mesh, want, "scheduler-0")
    # the requests queued at the dead replica are re-submitted to the other one
    assert r.migrated >= 1, r


def test_kill_the_kv_broker(chaos_mesh: Mesh, want: list[list[int]]) -> None:
    run(chaos_mesh, want, "kv-broker")


def test_kill_the_nats_server_then_new_requests_succeed(chaos_mesh: Mesh, want: list[list[int]]) -> None:
    run(chaos_mesh, want, "nats-server")
    fresh = asyncio.run(stream_many(chaos_mesh.url, chaos_mesh.model_name, PROMPTS[:8], MAX_TOKENS))
    assert [o.token_ids for o in fresh] == want[:8], [o.error for o in fresh]
    assert launcher_restarts(chaos_mesh, "nats-server", 1) == 1


def test_no_secret_in_any_log(chaos_mesh: Mesh) -> None:
    logs = list(chaos_mesh.log_dir.glob("*.log"))
    assert len(logs) >= 8
    for log in logs:
        assert PASSWORD not in log.read_text(errors="replace"), log.name
