"""The only worker of a role stalls past its liveness window (SIGSTOP), then comes back (SIGCONT) once the
gateway has migrated a stream away from it (`moemesh up` on the CPU, tiny model, one prefill and one decode
worker). Every stream must end with exactly the text of an undisturbed run, and no page is left held."""

# - The decode worker, mid-stream: the migrated requests avoid the worker they lost, yet are placed on it
#   again once its heartbeats resume, since it is the only live decode worker of the model (not refused 503
#   until their retries run out).
# - The prefill worker, before the prompts reach it: the decode worker reports it dead with their KV still
#   to come, and the migrated requests prefill on the decode worker; the resumed prefill worker then finds
#   only cancelled work.

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos import reference
from libs.chaos import metric_total, stream_many
from libs.chaos.load import Progress
from libs.chaos.overload import service_pids
from libs.chaos.scenarios import chaos_prompts, wait_serving
from libs.launch.mesh import Mesh, MeshConfig
from tests.e2e.conftest import assert_no_leaks

pytestmark = pytest.mark.e2e

N_REQUESTS, MAX_TOKENS, DEADLINE_S = 6, 32, 90.0
# 6..45 tokens: both the direct and the disaggregated path; other tokens per case, so that no case finds the
# prompts of another in the prefix caches (a cached prompt goes direct, past the stalled prefill worker)
PROMPTS = {
    "decode-0": chaos_prompts(N_REQUESTS),
    "prefill-0": [[(7 * t + 11) % 900 + 3 for t in p] for p in chaos_prompts(N_REQUESTS)],
    "killed": [[(13 * t + 5) % 900 + 3 for t in p] for p in chaos_prompts(N_REQUESTS)],
}
MIGRATIONS = "moemesh_gateway_migrations_total"


@pytest.fixture(scope="module")
def one_decode_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, log_dir=tmp_path_factory.mktemp("stall-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "16"},
            # a slower step: the streams are still running when the stall strikes
            "services.decode_worker": {"MOEMESH_DECODE_WORKER_FORWARD_SLEEP_MS": "25"},
            "services.gateway": {"MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": str(DEADLINE_S),
                                 "MOEMESH_GATEWAY_MAX_MIGRATIONS": "3"},
        },
    )  # fmt: skip
    with Mesh(cfg) as mesh:
        yield mesh
        assert_no_leaks(mesh)


@pytest.mark.parametrize("stalled_worker", ["decode-0", "prefill-0"])
def test_the_only_worker_of_a_role_stalls_and_every_stream_finishes(
    one_decode_mesh: Mesh, tiny_model: Path, stalled_worker: str
) -> None:
    mesh = one_decode_mesh
    prompts = PROMPTS[stalled_worker]
    want = reference(tiny_model, prompts, MAX_TOKENS)
    before = metric_total(mesh.url + "/metrics", MIGRATIONS)
    stalled: dict[str, float] = {}

    async def stall(progress: Progress) -> None:
        # the decode worker mid-stream; the prefill worker before the prompts reach it (their reservations on
        # the decode worker then lose it, and the migrated ones prefill on the decode worker)
        if stalled_worker == "decode-0" and not await progress.wait(N_REQUESTS, 2, timeout=DEADLINE_S):
            raise RuntimeError("the streams never all started")
        pid = service_pids(mesh)[stalled_worker]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:  # frozen until the gateway has noticed and migrated a stream away from it
            deadline = t0 + 30
            while await asyncio.to_thread(metric_total, mesh.url + "/metrics", MIGRATIONS) <= before:
                if time.monotonic() > deadline:
                    raise RuntimeError("no migration within 30 s of the stall")
                await asyncio.sleep(0.05)  # polling another process's counter
        finally:
            os.kill(pid, signal.SIGCONT)
        stalled["s"] = time.monotonic() - t0
        stalled["finished_before"] = progress.finished()

    outcomes = asyncio.run(
        stream_many(mesh.url, mesh.model_name, prompts, MAX_TOKENS, deadline_s=DEADLINE_S, fault=stall)
    )
    assert stalled["finished_before"] == 0, stalled  # it struck while every stream ran
    bad = [(o.index, o.error, o.hung, o.completion_tokens) for o in outcomes if not o.ok]
    assert not bad, f"streams that did not finish (index, error, hung, tokens): {bad}; stall {stalled}"
    assert [o.token_ids for o in outcomes] == want
    assert metric_total(mesh.url + "/metrics", MIGRATIONS) > before


def test_the_only_decode_worker_killed_mid_stream_and_restarted_takes_its_streams_back(
    one_decode_mesh: Mesh, tiny_model: Path
) -> None:
    """SIGKILL, as a crash: the supervisor restarts it under its old name (seconds: the process, torch, the
    model) while the migrated streams' re-submits are refused 503; the gateway retries them for
    `migration_wait_s` (30 s), the restarted worker takes them, and every stream ends with the undisturbed text."""
    mesh = one_decode_mesh
    prompts = PROMPTS["killed"]
    want = reference(tiny_model, prompts, MAX_TOKENS)
    restarts = mesh.sup.restarts("decode-0")
    seen: dict[str, float] = {}

    async def kill(progress: Progress) -> None:
        if not await progress.wait(N_REQUESTS, 2, timeout=DEADLINE_S):
            raise RuntimeError("the streams never all started")
        seen["finished_before"] = progress.finished()
        t0 = time.monotonic()
        await asyncio.to_thread(mesh.sup.kill, "decode-0")
        await asyncio.to_thread(wait_serving, mesh, "decode-0", restarts + 1, 90)
        seen["back_s"] = time.monotonic() - t0

    outcomes = asyncio.run(
        stream_many(mesh.url, mesh.model_name, prompts, MAX_TOKENS, deadline_s=DEADLINE_S, fault=kill)
    )
    assert seen["finished_before"] == 0, seen
    bad = [(o.index, o.error, o.hung, o.completion_tokens) for o in outcomes if not o.ok]
    assert not bad, f"streams that did not finish (index, error, hung, tokens): {bad}; {seen}"
    assert [o.token_ids for o in outcomes] == want
    assert mesh.sup.restarts("decode-0") == restarts + 1
