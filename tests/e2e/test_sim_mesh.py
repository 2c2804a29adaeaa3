"""The real mesh with timing-model workers (engine=sim, skip transport): 2 prefill + 2 decode worker
processes, the real gateway, scheduler (overlap_prefill on, its default: the prompt starts while the
decode worker reserves), kv-broker and nats-server. Both PD paths give the in-process SimEngine's deterministic text, the prefix index routes a repeated prompt to its cached blocks, and no
page is left behind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from libs.chaos import metric_total
from libs.engine import SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from libs.sim import SimEngine
from tests.e2e.conftest import assert_no_leaks, workers_env

pytestmark = pytest.mark.e2e
DIRECT_THRESHOLD = 8


@pytest.fixture(scope="module")
def sim_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    worker = {"ENGINE": "sim", "SIM_SPEED": "10"}
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, prefill_workers=2, decode_workers=2, transfer_protocol="skip",
        log_dir=tmp_path_factory.mktemp("sim-mesh-logs"),
        extra_env={
            "services.scheduler": {
                "MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD),
                "MOEMESH_SCHEDULER_OVERLAP_PREFILL": "true",  # PrefillStart alongside ReserveKv
            },
            **workers_env(worker),
        },
    )  # fmt: skip
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 37 + 11 * i) % 500 + 3 for i in range(n)]


def test_both_paths_stream_the_sim_engines_text(sim_mesh: Mesh, tiny_model: Path) -> None:
    engine = SimEngine.from_checkpoint(tiny_model)
    client = openai.OpenAI(base_url=f"{sim_mesh.url}/v1", api_key="none", max_retries=0)
    prompts = [_prompt(5, 1), _prompt(40, 2), _prompt(100, 3), _prompt(5, 4) * 3]  # direct, PD, PD, PD
    expect = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))

    def one(p: list[int]) -> openai.types.Completion:
        return client.completions.create(
            model=sim_mesh.model_name,
            prompt=p,
            max_tokens=12,
            temperature=0.7,
            extra_body={"ignore_eos": True},
        )

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, prompts * 2))
    for i, out in enumerate(got):
        want = expect[i % len(prompts)]
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 12


def test_a_repeated_prompt_reports_its_cached_prefix(sim_mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{sim_mesh.url}/v1", api_key="none", max_retries=0)
    p = _prompt(64, 9)
    first = client.completions.create(model=sim_mesh.model_name, prompt=p, max_tokens=2)
    deadline = time.monotonic() + 30  # the KV events reach the scheduler's index after the last token
    while metric_total(sim_mesh.metrics_url("scheduler"), "moemesh_scheduler_prefix_index_entries") < 8:
        assert time.monotonic() < deadline, "the scheduler's prefix index never saw the prompt's blocks"
        time.sleep(0.05)  # polls the scheduler's metrics: the condition lives in another process
    again = client.completions.create(model=sim_mesh.model_name, prompt=p + [7, 8], max_tokens=2)
    assert first.choices[0].text and again.choices[0].text
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and details.cached_tokens == 64  # all four full pages of the first prompt


def test_the_raw_load_generator_counts_what_the_gateway_streamed(sim_mesh: Mesh) -> None:
    """bench.scale_load's lean client (no HTTP library) against the real gateway: every request's tokens
    counted from the usage line, a TTFT each, keep-alive reused; a refused request counts as failed."""
    import asyncio

    from bench.scale_load import RawStream, StreamResult, closed_loop_raw

    res, wall = asyncio.run(closed_loop_raw(sim_mesh.url, sim_mesh.model_name, 4, 9, 12, 2))
    assert (res.ok, res.failed, res.tokens, len(res.ttft_ms)) == (8, 0, 8 * 9, 8) and wall > 0

    async def refused() -> StreamResult:
        out = StreamResult()
        host, port = sim_mesh.url.removeprefix("http://").split(":")
        conn = RawStream(host, int(port))
        await conn.post("/v1/completions", {"model": "no-such-model", "prompt": [1, 2], "stream": True}, out)
        await conn.close()
        return out

    bad = asyncio.run(refused())
    assert (bad.ok, bad.failed, bad.tokens) == (0, 1, 0)


def test_the_lean_submit_flood_counts_real_placements(sim_mesh: Mesh) -> None:
    """bench.scale_load's flood client straight to the scheduler: each submit ends ok only on its finished
    delta, and the scheduler counts one placement for each; a refused submit (unknown model) is failed
    at its SubmitReply, without waiting for the timeout."""
    import asyncio

    from bench.scale_load import flood_payloads, submit_flood_lean
    from proto import subjects

    url, stream = sim_mesh.metrics_url("scheduler"), subjects.stream("test-flood")
    before = metric_total(url, "moemesh_scheduler_placements_total")
    payloads = flood_payloads(sim_mesh.model_name, 12, 32, stream)
    res = asyncio.run(submit_flood_lean(sim_mesh.nats_url, payloads, stream, in_flight=5, timeout_s=60))
    # A 503 after placement (a worker the loaded CI box made miss its heartbeats, a lease run out) is what
    # a gateway migrates; this client does not, so it is allowed here, and still counts as a placement.
    # Refusals, other errors and submits left open fail the test.
    retryable = [e for e in res["errors"] if ": error 503:" in e]
    assert (res["ok"] + len(retryable), res["failed"]) == (12, len(retryable)), res["errors"]
    deadline = time.monotonic() + 10  # counted as the placement's last message leaves: read it settled
    while (placed := metric_total(url, "moemesh_scheduler_placements_total") - before) < 12:
        assert time.monotonic() < deadline, f"the scheduler counted {placed} placements of 12"
        time.sleep(0.05)  # polls the scheduler's metrics: the condition lives in another process
    assert placed == 12
    bad = flood_payloads("no-such-model", 3, 32, stream)
    t0 = time.monotonic()
    res = asyncio.run(submit_flood_lean(sim_mesh.nats_url, bad, stream, in_flight=2, timeout_s=60))
    assert (res["ok"], res["failed"]) == (0, 3) and time.monotonic() - t0 < 30
