"""The only decode worker stalls past its liveness window, then comes back (`moemesh up` on the CPU, tiny
model; one prefill and one decode worker, as on one GPU). SIGSTOP freezes every thread of it mid-stream;
the gateway declares it dead and migrates its streams; once the migration is counted, SIGCONT. Its
heartbeats resume, and the migrated requests, which avoid the worker they lost, are placed on it again:
it is the only live decode worker of the model (the scheduler used to refuse them, 503, until their retries
ran out). Every stream must end with exactly the text of an undisturbed run, and no page is left held."""

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
from libs.chaos.scenarios import chaos_prompts
from libs.launch.mesh import Mesh, MeshConfig
from tests.e2e.conftest import assert_no_leaks

pytestmark = pytest.mark.e2e

N_REQUESTS, MAX_TOKENS, DEADLINE_S = 6, 32, 90.0
PROMPTS = chaos_prompts(N_REQUESTS)  # 6..45 tokens: both the direct and the disaggregated path
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


def test_the_only_decode_worker_stalls_and_its_streams_finish_on_it(
    one_decode_mesh: Mesh, tiny_model: Path
) -> None:
    mesh = one_decode_mesh
    want = reference(tiny_model, PROMPTS, MAX_TOKENS)
    before = metric_total(mesh.url + "/metrics", MIGRATIONS)
    stalled: dict[str, float] = {}

    async def stall(progress: Progress) -> None:
        if not await progress.wait(N_REQUESTS, 2, timeout=DEADLINE_S):
            raise RuntimeError("the streams never all started")
        pid = service_pids(mesh)["decode-0"]
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
        stream_many(mesh.url, mesh.model_name, PROMPTS, MAX_TOKENS, deadline_s=DEADLINE_S, fault=stall)
    )
    assert stalled["finished_before"] == 0, stalled  # it struck while every stream ran
    bad = [(o.index, o.error, o.hung, o.completion_tokens) for o in outcomes if not o.ok]
    assert not bad, f"streams that did not finish (index, error, hung, tokens): {bad}; stall {stalled}"
    assert [o.token_ids for o in outcomes] == want
    assert metric_total(mesh.url + "/metrics", MIGRATIONS) > before
