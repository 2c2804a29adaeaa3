"""The mesh with expert parallelism: `moemesh up --ep-size 2` on CPU — the prefill and the decode worker each
run 2 EP rank processes (gloo), KV pages cross between the two groups' shared pools over Mooncake TCP.
Greedy text must equal the single-rank engine's, which test_mesh.py shows equals the EP 1 mesh. The workers
are given GPUs as `--prefill-gpus 0,1 --decode-gpus 2,3` would (CUDA_VISIBLE_DEVICES, unused on the CPU):
every rank process must have been given its worker's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from libs.chaos import metric_total
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from libs.tokenizer import Tokenizer
from tests.e2e.conftest import DIRECT_THRESHOLD, assert_no_leaks

pytestmark = pytest.mark.e2e
EP = 2
PAGES = 128  # per rank (the default sizes each rank's pool for 64 long sequences)
GPUS = {"prefill-0": "0,1", "decode-0": "2,3"}


@pytest.fixture(scope="module")
def ep_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model,
        port=0,
        ep_size=EP,
        log_dir=tmp_path_factory.mktemp("ep-mesh-logs"),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(DIRECT_THRESHOLD)},
            "services.prefill_worker": {"MOEMESH_PREFILL_WORKER_NUM_PAGES": str(PAGES)},
            "services.decode_worker": {"MOEMESH_DECODE_WORKER_NUM_PAGES": str(PAGES)},
        },
        worker_gpus=GPUS,
    )
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)  # every rank's request pages back (summed in the workers' stats)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    return Engine.from_pretrained(tiny_model)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 1000 + 3 for i in range(n)]


def greedy_text(engine: Engine, tok: Tokenizer, prompt: list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return tok.decode(engine.generate([prompt], params)[0].token_ids)


def test_ep2_mesh_gives_the_single_rank_greedy_text(ep_mesh: Mesh, engine: Engine, tiny_model: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_model)
    prompts = [prompt_of(n, n) for n in (DIRECT_THRESHOLD - 3, 40, 90, 23, 61)]  # direct + disaggregated

    async def one(client: openai.AsyncOpenAI, p: list[int]) -> str:
        r = await client.completions.create(
            model=ep_mesh.model_name, prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None and r.usage.completion_tokens == 16
        return r.choices[0].text

    async def all_at_once() -> list[str]:  # concurrent, so both ranks of each worker get requests
        client = openai.AsyncOpenAI(base_url=f"{ep_mesh.url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_at_once())
    assert got == [greedy_text(engine, tok, p, 16) for p in prompts]
    assert metric_total(ep_mesh.metrics_url("prefill-0"), "moemesh_kv_transfer_bytes_total") > 0
    # every routed token of both groups counted: K experts per token per MoE layer
    assert metric_total(ep_mesh.metrics_url("decode-0"), "moemesh_expert_load_tokens_total") > 0
    routed = metric_total(ep_mesh.metrics_url("prefill-0"), "moemesh_expert_load_tokens_total")
    assert routed >= 4 * 2 * (40 + 90 + 23 + 61)
    assert metric_total(ep_mesh.metrics_url("decode-0"), "moemesh_ep_ranks") == EP


def _stat(pid: str) -> tuple[int, int]:
    """(ppid, pgid) from /proc/<pid>/stat (the command name in parentheses may hold spaces)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2])


def _visible(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")), None)


def rank_pids(worker_pid: int) -> list[int]:
    """The EP rank processes of a worker: the children of its multiprocessing forkserver."""
    group = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid, pgid = _stat(pid)
            if pgid == worker_pid:
                group[int(pid)] = (ppid, Path(f"/proc/{pid}/cmdline").read_bytes())
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone while listed
    servers = [p for p, (_, cmd) in group.items() if b"forkserver" in cmd and p != worker_pid]
    return sorted(p for p, (ppid, _) in group.items() if ppid in servers)


def test_each_rank_process_was_given_its_workers_gpus(ep_mesh: Mesh) -> None:
    for worker, gpus in GPUS.items():
        pid = ep_mesh.sup.procs[worker].proc.pid
        ranks = rank_pids(pid)
        assert len(ranks) == EP, (worker, ranks)
        assert [_visible(p) for p in [pid, *ranks]] == [gpus] * (EP + 1), worker
    assert _visible(ep_mesh.sup.procs["gateway"].proc.pid) == os.environ.get("CUDA_VISIBLE_DEVICES")
