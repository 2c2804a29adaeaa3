"""`moemesh up --scheduler embedded` through the real launcher: no scheduler process, two gateways each
hosting a scheduler replica, the tiny model on real workers (Mooncake TCP). Streamed completions carry
the in-process engine's greedy tokens on both PD paths, and concurrent streams spread over both gateways
all complete."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.chaos import metric_total, stream_many
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from tests.e2e.conftest import DIRECT_THRESHOLD, assert_no_leaks

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
RECEIVED = 'moemesh_gateway_requests_received_total{endpoint="completions"}'


@pytest.fixture(scope="module")
def embedded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, gateways=2, embedded_scheduler=True,
        log_dir=tmp_path_factory.mktemp("embedded-logs"),
        extra_env={"services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)}},
    )  # fmt: skip
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def test_completions_stream_the_engines_tokens_through_gateways_hosting_their_schedulers(
    embedded: Mesh, tiny_model: Path
) -> None:
    mesh = embedded
    assert mesh.scheduler_names() == [] and not any(n.startswith("scheduler") for n in mesh.sup.procs)
    # both paths (direct below the threshold, disaggregated above), a connection per stream
    prompts = [[(11 * i + 7 * k) % 900 + 3 for k in range(4 + 9 * (i % 6))] for i in range(16)]
    assert {len(p) <= DIRECT_THRESHOLD for p in prompts} == {True, False}
    engine = Engine.from_pretrained(tiny_model)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompts, greedy)]

    before = [metric_total(u, RECEIVED) for u in mesh.gateway_metrics_urls()]
    outs = asyncio.run(stream_many(mesh.url, mesh.model_name, prompts, MAX_TOKENS))
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert [o.token_ids for o in outs] == want
    took = [metric_total(u, RECEIVED) - b for u, b in zip(mesh.gateway_metrics_urls(), before, strict=True)]
    assert sum(took) == len(prompts) and min(took) > 0, took  # each gateway served (and submitted) some
