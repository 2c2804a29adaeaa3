"""Chaos on the real mesh (CPU, tiny model): 2 prefill + 2 decode workers, 2 scheduler replicas, the
kv-broker, the gateway and a nats-server requiring a user/password, each its own process. While 64
greedy streaming requests run, one component is killed with SIGKILL (or restarted); every request must
then finish with exactly the text of an undisturbed run (the in-process Engine on the same checkpoint)
or end with a clear error event before its deadline; none hangs; and once traffic stops every live
worker holds no request pages (cached prefix pages aside). The killed service is restarted afterwards,
so the scenarios run in turn on one mesh."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.chaos import FaultResult, stream_many
from libs.chaos.scenarios import chaos_config, chaos_prompts, restart_service, run_fault, standard_faults
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh
from libs.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

N_REQUESTS, MAX_TOKENS, DEADLINE_S, LEASE_MS = 64, 16, 60.0, 4000
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
def want(tiny_model: Path) -> list[str]:
    engine = Engine.from_pretrained(tiny_model)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tok = Tokenizer.from_pretrained(tiny_model)
    return [tok.decode(o.token_ids) for o in outs]


FAULTS = {f.killed: f for f in standard_faults(N_REQUESTS)}


def run(mesh: Mesh, want: list[str], killed: str) -> FaultResult:
    """One standard fault (libs.chaos.scenarios) while every prompt streams, with the checks every
    scenario shares; the struck service is restarted afterwards."""
    fault = FAULTS[killed]
    result, left = run_fault(
        mesh, fault, PROMPTS, want, MAX_TOKENS, deadline_s=DEADLINE_S, leak_timeout_s=LEASE_MS / 1000 + 10
    )
    print(result)  # the table row, with -s
    assert all(v == 0 for v in left.values()), f"pages or requests left on live workers: {left}"
    assert result.hung == 0 and result.wrong == 0, result
    assert result.completed + result.errors == N_REQUESTS, result
    assert all(msg for msg in result.error_samples), result  # errors say what happened
    if fault.restart:
        restart_service(mesh, killed)
    return result


def test_kill_a_decode_worker_mid_stream_migrates_its_requests(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run(chaos_mesh, want, "decode-0")
    assert r.migrated >= 1 and r.errors == 0 and r.completed == N_REQUESTS, r


def test_kill_a_prefill_worker(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run(chaos_mesh, want, "prefill-1")
    assert r.errors == 0 and r.completed == N_REQUESTS, r


def test_kill_a_scheduler_replica(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run(chaos_mesh, want, "scheduler-0")
    # the requests queued at the dead replica are re-submitted to the other one
    assert r.migrated >= 1 and r.errors == 0 and r.completed == N_REQUESTS, r


def test_restart_the_kv_broker(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run(chaos_mesh, want, "kv-broker")
    assert r.completed >= N_REQUESTS // 2, r


def test_restart_nats_server_then_new_requests_succeed(chaos_mesh: Mesh, want: list[str]) -> None:
    run(chaos_mesh, want, "nats-server")
    fresh = asyncio.run(stream_many(chaos_mesh.url, chaos_mesh.model_name, PROMPTS[:8], MAX_TOKENS))
    assert [o.text for o in fresh] == want[:8], [o.error for o in fresh]


def test_no_secret_in_any_log(chaos_mesh: Mesh) -> None:
    logs = list(chaos_mesh.log_dir.glob("*.log"))
    assert len(logs) >= 8
    for log in logs:
        assert PASSWORD not in log.read_text(errors="replace"), log.name
