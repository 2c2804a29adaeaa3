"""KV tiers through the real mesh (`moemesh up --kv-store`'s shape: a supervised mooncake_master, 1 prefill
and 2 decode workers with small device pools, a host tier and the shared store): multi-turn chats on the
disaggregated and direct paths stream the single engine's greedy text while pages go to host memory and
come back; a prompt computed on one decode worker is served to the other from the store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from libs.chaos import metric_total
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import MOONCAKE, Mesh, MeshConfig
from libs.tokenizer import Tokenizer
from proto import decoder, subjects
from proto import messages as m
from tests.e2e.conftest import assert_no_leaks, workers_env

pytestmark = pytest.mark.e2e

PS = 4
MODEL = "tiny-v3"  # the tiny checkpoint's folder name
DIRECT = 40  # uncached prompt tokens up to this go straight to a decode worker (the store test: A and B)


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    env = workers_env({"PAGE_SIZE": str(PS), "HOST_KV_PAGES": "64", "KV_STORE_TIMEOUT_S": "5"})
    env["services.decode_worker"].update(
        MOEMESH_DECODE_WORKER_NUM_PAGES="16", MOEMESH_DECODE_WORKER_FORWARD_SLEEP_MS="40"
    )
    # a full hit is worth half a queued request: load decides between the decode workers (the store test),
    # and a store hit counts almost as much as a device hit toward going direct (its B goes direct)
    env["services.scheduler"] = {
        "MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT), "MOEMESH_SCHEDULER_PREFIX_WEIGHT": "0.5",
        "MOEMESH_SCHEDULER_PREFIX_HOST_WEIGHT": "1", "MOEMESH_SCHEDULER_PREFIX_STORE_WEIGHT": "0.9",
    }  # fmt: skip
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, prefill_workers=1, decode_workers=2, kv_store=True, extra_env=env,
        log_dir=tmp_path_factory.mktemp("kv-tiers-logs"),
    )  # fmt: skip
    with Mesh(cfg) as mesh:
        yield mesh
        assert_no_leaks(mesh)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Engine:
    return Engine.from_pretrained(tiny_model, page_size=PS, enable_prefix_cache=False)


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def want(reference: Engine, prompt: list[int]) -> list[int]:
    return reference.generate([prompt], GREEDY)[0].token_ids


async def complete(client: httpx.AsyncClient, prompt: list[int], n: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def total(mesh: Mesh, workers: list[str], name: str, label: str = "") -> float:
    return sum(metric_total(mesh.metrics_url(w), name + label) for w in workers)


def test_multi_turn_chats_give_the_engines_text_with_pages_offloaded_and_loaded_back(
    mesh, reference, tok
) -> None:
    system = [(11 * i) % 900 + 5 for i in range(16)]
    chats = [system + [(17 * j + 101 * i) % 900 + 5 for j in range(30)] for i in range(3)]  # a pool holds one

    async def run() -> None:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
            for turn in range(2):  # turn 1 disaggregated (nothing cached), turn 2 mostly direct
                ids = [o.token_ids for o in reference.generate(chats, GREEDY)]
                for i, chat in enumerate(chats):  # one at a time: each worker serves several chats
                    got = await complete(client, chat, 4)
                    assert got["choices"][0]["text"] == tok.decode(ids[i]), (turn, i)
                chats[:] = [c + i + [960 + turn] * 3 for c, i in zip(chats, ids, strict=True)]

    asyncio.run(run())
    workers = mesh.worker_ids(m.Role.PREFILL) + mesh.worker_ids(m.Role.DECODE)
    assert total(mesh, workers, "moemesh_kv_tier_bytes_total", '{direction="device_to_host"}') > 0
    assert total(mesh, workers, "moemesh_kv_tier_hit_pages_total", '{tier="host"}') > 0
    assert mesh.sup.procs[MOONCAKE].alive


async def heard_one_decode_worker_idle(mesh: Mesh, timeout: float = 10.0) -> None:
    """Until heartbeats sent from now on show one decode worker idle and the other busy."""
    since_ms = time.time() * 1000
    latest: dict[str, m.WorkerHeartbeat] = {}
    dec = decoder(m.Heartbeat)
    nc = await nats.connect(mesh.nats_url, **mesh.connect_options())
    done = asyncio.Event()

    async def on_hb(msg) -> None:
        hb = dec.decode(msg.data)
        if isinstance(hb, m.WorkerHeartbeat) and hb.role == m.Role.DECODE and hb.sent_ms > since_ms:
            latest[hb.worker_id] = hb
            busy = sorted(h.running + h.pending + h.waiting > 0 for h in latest.values())
            if busy == [False, True]:
                done.set()

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_hb)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await nc.close()


def test_a_prompt_computed_on_one_decode_worker_is_served_to_the_other_from_the_store(
    mesh, reference, tok
) -> None:
    """Load steers placement: L1 holds one decode worker (X) while A's prompt P is computed for the
    other (Y); then L2 holds Y, L1 ends, and B (P and a few tokens) goes to X, which has P from the store."""
    p = [(13 * i) % 900 + 7 for i in range(36)]
    decode = mesh.worker_ids(m.Role.DECODE)
    before = total(mesh, decode, "moemesh_kv_tier_hit_pages_total", '{tier="store"}')
    put_before = total(mesh, decode, "moemesh_kv_tier_bytes_total", '{direction="host_to_store"}')

    async def stored() -> None:  # A's pages written through to the store before B is placed
        async with asyncio.timeout(30):
            while total(mesh, decode, "moemesh_kv_tier_bytes_total", '{direction="host_to_store"}') <= put_before:
                await asyncio.sleep(0.05)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
            l1 = asyncio.create_task(complete(client, [3, 4, 5], 40))  # 11 of a pool's 16 pages
            await asyncio.sleep(0)  # L1 submitted first
            a = await complete(client, p, 4)
            assert a["choices"][0]["text"] == tok.decode(want(reference, p))
            l2 = asyncio.create_task(complete(client, [6, 7, 8], 56))
            await l1
            await stored()
            await heard_one_decode_worker_idle(mesh)  # the scheduler sees the load as it is now
            b_prompt = p + [970, 971, 972]
            b = await complete(client, b_prompt, 4)
            assert b["choices"][0]["text"] == tok.decode(want(reference, b_prompt))
            assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(p) // PS * PS
            await l2

    asyncio.run(run())
    assert total(mesh, decode, "moemesh_kv_tier_hit_pages_total", '{tier="store"}') >= before + len(p) // PS
