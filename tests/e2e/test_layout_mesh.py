"""DeepSeek-V3's released layout (names, dtypes, the 163-shard index; 4 layers here) served by the mesh with
PD: prompts past the direct-prefill threshold cross from the prefill worker over Mooncake, shorter ones
prefill on the decode worker; both give the in-process Engine's greedy text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from libs.chaos import metric_total
from libs.engine import Engine, SamplingParams
from libs.engine.layout_model import write_layout_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.tokenizer import Tokenizer
from tests.e2e.conftest import DIRECT_THRESHOLD, assert_no_leaks, workers_env

pytestmark = pytest.mark.e2e


def test_the_released_layout_through_pd_gives_the_engines_greedy_text(tmp_path: Path) -> None:
    model = write_layout_model(tmp_path / "v3-layout-4", layers=4)
    prompts = [[(7 * i + n) % 1000 + 3 for i in range(n)] for n in (DIRECT_THRESHOLD - 2, 30, 45)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tok = Tokenizer.from_pretrained(model)
    want = [tok.decode(o.token_ids) for o in Engine.from_pretrained(model, num_pages=64).generate(prompts, greedy)]
    cfg = MeshConfig(
        model_dir=model, port=0, log_dir=tmp_path / "logs",
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
            **workers_env({"NUM_PAGES": "64"}),
        },
    )  # fmt: skip

    async def ask(url: str, name: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        rs = await asyncio.gather(*(
            client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
            for p in prompts
        ))  # fmt: skip
        return [r.choices[0].text for r in rs]

    with Mesh(cfg) as mesh:
        assert asyncio.run(ask(mesh.url, mesh.model_name)) == want
        assert metric_total(mesh.metrics_url("prefill-0"), "moemesh_kv_transfer_bytes_total") > 0  # PD ran
        assert_no_leaks(mesh)
