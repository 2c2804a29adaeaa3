"""Batched prefill through the real mesh: prompts that reach the prefill worker together share forwards
(chunked under a 64-token budget, long prompts' KV streamed over Mooncake TCP chunk by chunk), and every
greedy completion equals the in-process engine prefilling that prompt alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from libs.chaos import metric_total
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from tests.e2e.conftest import assert_no_leaks

pytestmark = pytest.mark.e2e

BUDGET = 64  # the prefill worker's max_prefill_tokens: prompts past it run in several chunks
N = 12
PROMPTS = [[(11 * i + 7 * k) % 1000 + 3 for i in range(20 + 17 * k)] for k in range(N)]  # 20..207 tokens
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, log_dir=tmp_path_factory.mktemp("mesh-logs"),
        extra_env={
            # all disaggregated; the PrefillTask (with the decode handle) comes before the prompt is
            # queued, so the KV stream watches every chunk: with PrefillStart overlapped, a batch that
            # finishes before the reservation returns sends all its KV after the last chunk
            "services.scheduler": {
                "MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "0",
                "MOEMESH_SCHEDULER_OVERLAP_PREFILL": "false",
            },
            "services.prefill_worker": {"MOEMESH_PREFILL_WORKER_MAX_PREFILL_TOKENS": str(BUDGET)},
        },
    )  # fmt: skip
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def multi_prompt_forwards(url: str) -> float:
    """Prefill forwards so far that held more than one prompt (the batch-size histogram)."""
    text = httpx.get(url, timeout=10).text
    one = total = None
    for line in text.splitlines():
        if line.startswith('moemesh_prefill_batch_prompts_bucket{le="1.0"}'):
            one = float(line.rsplit(" ", 1)[1])
        elif line.startswith("moemesh_prefill_batch_prompts_count"):
            total = float(line.rsplit(" ", 1)[1])
    assert one is not None and total is not None, "no batch-size histogram in the prefill worker's /metrics"
    return total - one


def single_prefill_tokens(tiny_model: Path) -> list[list[int]]:
    """Each prompt alone through an engine with the prefill worker's chunk budget (no batching)."""
    engine = Engine.from_pretrained(tiny_model, max_prefill_tokens=BUDGET)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0].token_ids for p in PROMPTS]


async def _completions(mesh: Mesh) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="none", max_retries=0, timeout=120)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    async def one(p: list[int]) -> list[int]:
        r = await client.completions.create(
            model=mesh.model_name,
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body=extra,
        )
        tokens = r.choices[0].logprobs.tokens if r.choices[0].logprobs else None
        assert tokens is not None
        return [int(t.removeprefix("token_id:")) for t in tokens]

    return await asyncio.gather(*(one(p) for p in PROMPTS))


def test_concurrent_prompts_share_prefill_forwards_and_each_equals_a_single_prefill(
    mesh: Mesh, tiny_model: Path
) -> None:
    url = mesh.metrics_url("prefill-0")
    shared0, early0 = multi_prompt_forwards(url), metric_total(url, "moemesh_kv_transfer_early_bytes_total")
    got = asyncio.run(_completions(mesh))
    want = single_prefill_tokens(tiny_model)
    wrong = [k for k in range(N) if got[k] != want[k]]
    assert not wrong, f"prompts {wrong} differ from a single prefill: {[(got[k], want[k]) for k in wrong]}"
    assert multi_prompt_forwards(url) > shared0  # some forwards held several of these prompts
    assert metric_total(url, "moemesh_kv_transfer_early_bytes_total") > early0  # KV streamed mid-prompt
