"""The mesh with MTP speculative decoding on the decode worker (`MOEMESH_DECODE_WORKER_MTP_K=2`),
serving a briefly trained demo-recipe checkpoint: greedy text through the OpenAI API equals the plain
in-process engine's, on both paths (short prompts prefilled by the decode worker, long ones by the
prefill worker and moved over Mooncake TCP), drafts are accepted, and no page leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from libs.chaos import metric_total
from libs.demo.train import build_demo_model, quick_settings
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from tests.e2e.conftest import DIRECT_THRESHOLD, assert_no_leaks

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "demo-v3"
    return build_demo_model(out, quick_settings(steps=60, batch_size=4, seq_len=64), log=lambda _: None)


@pytest.fixture(scope="module")
def mtp_mesh(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=demo,
        port=0,
        log_dir=tmp_path_factory.mktemp("mtp-mesh-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
            "services.decode_worker": {"MOEMESH_DECODE_WORKER_MTP_K": "2"},
        },
    )
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def test_mtp_mesh_gives_the_plain_greedy_text(mtp_mesh: Mesh, demo: Path) -> None:
    engine = Engine.from_pretrained(demo)
    assert engine.tokenizer is not None
    texts = ["A list is", "The import statement", "class", "A dictionary maps keys to values; the for loop"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    assert min(map(len, prompts)) < DIRECT_THRESHOLD < max(map(len, prompts))  # both paths
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [engine.tokenizer.decode(o.token_ids) for o in engine.generate(prompts, params)]

    async def one(client: openai.AsyncOpenAI, p: list[int]) -> str:
        r = await client.completions.create(
            model=mtp_mesh.model_name, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None and r.usage.completion_tokens == 24
        return r.choices[0].text

    async def all_at_once() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{mtp_mesh.url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == want
    assert metric_total(mtp_mesh.metrics_url("decode-0"), "moemesh_mtp_accepted_tokens_total") > 0
