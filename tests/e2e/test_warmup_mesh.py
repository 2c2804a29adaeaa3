"""The mesh with both workers warming up at start (`MOEMESH_*_WORKER_WARMUP=on`, what `auto` does on CUDA):
the mesh is up only after each worker's warm-up (its time exported before the first heartbeat), every page
is free again, and greedy text on both PD paths equals the in-process Engine's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libs.chaos import metric_total
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from tests.e2e.conftest import DIRECT_THRESHOLD, assert_no_leaks, workers_env

pytestmark = pytest.mark.e2e

WORKERS = ("prefill-0", "decode-0")


@pytest.fixture(scope="module")
def warm_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    on = {"WARMUP": "on", "MAX_PREFILL_TOKENS": "64", "MAX_NUM_SEQS": "8"}
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, log_dir=tmp_path_factory.mktemp("warm-mesh-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
            **workers_env(on),
        },
    )  # fmt: skip
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


def test_workers_warm_up_before_the_mesh_is_up_and_free_every_page(warm_mesh: Mesh) -> None:
    for w in WORKERS:
        assert metric_total(warm_mesh.metrics_url(w), "moemesh_worker_warmup_seconds") > 0, w
        assert metric_total(warm_mesh.metrics_url(w), "moemesh_kv_pages_used") == 0, w
    decode_log = (warm_mesh.log_dir / "decode-0.log").read_text()
    assert "decode batches [1, 2, 4, 8]" in decode_log and "warm-up: " in decode_log  # each graph size
    assert "prefill lengths [1, 2, 4, 8, 16, 32, 64]" in (warm_mesh.log_dir / "prefill-0.log").read_text()


def test_greedy_text_after_warm_up_equals_the_engines(warm_mesh: Mesh, tiny_model: Path) -> None:
    prompts = [[(5 * i + 3) % 500 + 3 for i in range(n)] for n in (5, 40)]  # direct and through PD
    assert min(map(len, prompts)) < DIRECT_THRESHOLD < max(map(len, prompts))
    want = Engine.from_pretrained(tiny_model).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    for p, ref in zip(prompts, want, strict=True):
        body = {
            "model": warm_mesh.model_name, "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True,
        }  # fmt: skip
        r = httpx.post(f"{warm_mesh.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert [int(t.removeprefix("token_id:")) for t in tokens] == ref.token_ids
