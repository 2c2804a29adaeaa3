"""The EP mesh with per-rank KV pools (`ep_kv_per_rank`, what GPU workers always do) on CPU: every rank of
the prefill and decode workers registers its own pool with its own Mooncake TCP engine, the decode worker's
handles name the rank holding each request, and the prefill rank holding the prompt writes into that
rank's pool. Greedy text must equal the single-rank engine's on every concurrent stream (KV landing in the
wrong rank's pool would change it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from libs.chaos import metric_total
from libs.engine import Engine
from libs.launch.mesh import Mesh, MeshConfig
from libs.tokenizer import Tokenizer
from tests.e2e.conftest import DIRECT_THRESHOLD, assert_no_leaks, workers_env
from tests.e2e.test_ep_mesh import greedy_text, prompt_of

pytestmark = pytest.mark.e2e
PAGES = 128  # per rank


@pytest.fixture(scope="module")
def rank_pool_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    per_rank = {"EP_KV_PER_RANK": "true", "NUM_PAGES": str(PAGES)}
    cfg = MeshConfig(
        model_dir=tiny_model,
        port=0,
        ep_size=2,
        log_dir=tmp_path_factory.mktemp("ep-rank-pools-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
            **workers_env(per_rank),
        },
    )
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def test_rank_pools_give_the_single_rank_greedy_text(rank_pool_mesh: Mesh, tiny_model: Path) -> None:
    engine = Engine.from_pretrained(tiny_model)
    tok = Tokenizer.from_pretrained(tiny_model)
    prompts = [prompt_of(n, n) for n in (40, 90, 23, 61)]  # all disaggregated: every KV crosses ranks' pools

    async def one(client: openai.AsyncOpenAI, p: list[int]) -> str:
        r = await client.completions.create(
            model=rank_pool_mesh.model_name, prompt=p, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].text

    async def all_at_once() -> list[str]:  # concurrent, so both ranks of each worker hold requests
        client = openai.AsyncOpenAI(
            base_url=f"{rank_pool_mesh.url}/v1", api_key="none", max_retries=0, timeout=120
        )
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == [greedy_text(engine, tok, p, 12) for p in prompts]
    assert metric_total(rank_pool_mesh.metrics_url("prefill-0"), "moemesh_kv_transfer_bytes_total") > 0
