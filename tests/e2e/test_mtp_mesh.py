"""The mesh with MTP speculative decoding on the decode worker (`MOEMESH_DECODE_WORKER_MTP_K=2`, a briefly
trained demo-recipe checkpoint): greedy API text equals the plain in-process engine's on both the direct and
the PD path, drafts are accepted, and no page leaks."""

# Three meshes: the decode worker's attention on the torch reference (verify as absorbed chunks), on the
# paged backend (verify and draft as decode rows, libs/engine/spec_graphs.py), and with 2 EP ranks per worker
# (every decode rank drafts with its own MTP module). On the PD path the KV moves over Mooncake TCP and the
# decode side drafts after the handoff.

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


@pytest.fixture(
    scope="module", params=[("torch", 1), ("triton", 1), ("torch", 2)], ids=["torch", "paged-rows", "ep2"]
)
def mtp_mesh(demo: Path, tmp_path_factory: pytest.TempPathFactory, request) -> Iterator[Mesh]:
    """The decode worker's attention backend and EP size (ep2: both workers run 2 EP rank processes, each
    decode rank an MTPEngine)."""
    attention, ep = request.param
    decode_env = {"MOEMESH_DECODE_WORKER_MTP_K": "2", "MOEMESH_DECODE_WORKER_ATTENTION_BACKEND": attention}
    prefill_env = {}
    if ep > 1:  # per rank: the default sizes each rank's pool for 64 long sequences
        decode_env["MOEMESH_DECODE_WORKER_NUM_PAGES"] = prefill_env["MOEMESH_PREFILL_WORKER_NUM_PAGES"] = (
            "128"
        )
    cfg = MeshConfig(
        model_dir=demo,
        port=0,
        ep_size=ep,
        log_dir=tmp_path_factory.mktemp("mtp-mesh-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
            "services.prefill_worker": prefill_env,
            "services.decode_worker": decode_env,
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

    decode_metrics = mtp_mesh.metrics_url("decode-0")
    accepted_before = metric_total(decode_metrics, "moemesh_mtp_accepted_tokens_total")
    assert asyncio.run(all_at_once()) == want
    assert metric_total(decode_metrics, "moemesh_mtp_accepted_tokens_total") > accepted_before
    assert metric_total(mtp_mesh.metrics_url("prefill-0"), "moemesh_kv_transfer_bytes_total") > 0  # PD ran


def test_mtp_drafts_after_a_pd_handoff(mtp_mesh: Mesh, demo: Path) -> None:
    """Long prompts only: every request joins the decode worker from the prefill worker, whose KV moved
    over Mooncake; the decode side drafts from its second step on, and the text is still plain greedy."""
    engine = Engine.from_pretrained(demo)
    assert engine.tokenizer is not None
    texts = [
        "The for statement is used to iterate over the elements of a sequence",
        "A dictionary maps keys to values",
    ]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    assert min(map(len, prompts)) > DIRECT_THRESHOLD
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [engine.tokenizer.decode(o.token_ids) for o in engine.generate(prompts, params)]
    decode_metrics, prefill_metrics = mtp_mesh.metrics_url("decode-0"), mtp_mesh.metrics_url("prefill-0")
    before = [metric_total(decode_metrics, f"moemesh_mtp_{n}_tokens_total") for n in ("drafted", "accepted")]
    moved = metric_total(prefill_metrics, "moemesh_kv_transfer_bytes_total")
    client = openai.OpenAI(base_url=f"{mtp_mesh.url}/v1", api_key="none", max_retries=0, timeout=120)
    got = [
        client.completions.create(
            model=mtp_mesh.model_name, prompt=p, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    ]
    assert got == want
    assert metric_total(prefill_metrics, "moemesh_kv_transfer_bytes_total") > moved
    after = [metric_total(decode_metrics, f"moemesh_mtp_{n}_tokens_total") for n in ("drafted", "accepted")]
    assert after[0] - before[0] >= 2 * len(prompts)  # k = 2 drafts per step, from each request's second on
    assert after[1] > before[1]
