"""The benchmark client against the real embedded mesh (nats-server, every service, tiny model, CPU),
with the gateway's admin endpoints on: one short CLI run, and the slow-down experiment at small scale."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libs.cli.main import main
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.loadgen.benchmark import Clients
from libs.loadgen.client import Endpoint
from libs.loadgen.datasets import random_requests
from libs.loadgen.slowdown import SlowdownConfig, slowdown_experiment

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)
    cfg = MeshConfig(
        model_dir=model,
        port=0,
        log_dir=tmp_path_factory.mktemp("mesh-logs"),
        extra_env={"services.gateway": {"MOEMESH_GATEWAY_ENABLE_ADMIN": "1"}},
    )
    with Mesh(cfg) as m:
        yield m


@pytest.mark.parametrize("client", [[], ["--client", "httpx"], ["--client-procs", "2"]], ids=str)
def test_cli_run_writes_results_whose_counts_match_the_dataset(
    mesh: Mesh, tmp_path: Path, client: list[str]
) -> None:
    """The same result with the raw client (the default for http://), httpx, or two client processes."""
    out = tmp_path / "result.json"
    argv = [
        "bench", *client, "--base-url", mesh.url, "--num-prompts", "8", "--random-input-len", "32",
        "--random-output-len", "6", "--random-range-ratio", "0.5", "--max-concurrency", "4",
        "--random-vocab-size", "1000", "--seed", "5", "--output-file", str(out), "--disable-progress",
        *([] if client else ["--plot-dir", str(tmp_path)]),  # plotting is the same whatever sent
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["max_concurrency"] == 4 and [r["index"] for r in data["requests"]] == list(range(8))
    want = random_requests(8, 32, 6, 0.5, vocab_size=1000, seed=5)
    s, reqs = data["summary"], data["requests"]
    assert data["config"]["model"] == mesh.model_name  # the first of /v1/models
    assert (s["completed"], s["failed"], len(reqs)) == (8, 0, 8)
    assert [r["completion_tokens"] for r in reqs] == [w.output_len for w in want]  # ignore_eos held them
    assert [r["prompt_tokens"] for r in reqs] == [w.input_len for w in want]
    assert s["total_output_tokens"] == sum(w.output_len for w in want)
    assert 0 < s["concurrency"] <= 4.0 + 1e-9
    assert s["ttft_ms"]["count"] == 8 and s["ttft_ms"]["median"] > 0
    assert client or (tmp_path / "latency_cdf.png").stat().st_size > 10_000


async def test_slowdown_fills_the_decode_batch_before_release(mesh: Mesh) -> None:
    # 300-token prompts go through the prefill worker (longer than the direct-prefill threshold) while
    # the decode worker is held back, as in the seed's method. Two client processes send the requests;
    # this one watches the batch and releases: their chunk times and its release share one clock.
    base, reqs = (random_requests(6, 300, 24, vocab_size=1000, seed=s) for s in (0, 1))
    result = await slowdown_experiment(
        Endpoint(mesh.url, model=mesh.model_name),
        base,
        reqs,
        SlowdownConfig(slowdown_ms=300, release_at_batch=6),
        Clients(procs=2),
    )
    assert [r.index for r in result["slowdown"]["records"]] == list(range(6))
    slowed = result["slowdown"]
    assert (slowed["release_reason"], slowed["batch_at_release"]) == ("target", 6)
    assert slowed["finished_before_release"] == 0
    assert all(r.ok and r.completion_tokens == 24 for r in slowed["records"] + result["baseline"]["records"])
    assert slowed["full_batch"]["requests"] == 6 and result["full_batch_decode_tokens_per_s"] > 0
    assert result["baseline_decode_tokens_per_s"] > 0
    workers = httpx.get(f"{mesh.url}/admin/workers", timeout=10).json()["workers"]
    assert [w["forward_sleep_ms"] for w in workers if w["role"] == "decode"] == [0.0]  # released for good


async def test_slowdown_holds_decode_back_until_released(mesh: Mesh) -> None:
    # A target above the request count: the batch stops growing at 6 and is released after stall_s, so
    # the requests stream under slow-down for a while first: one token per forward, >= 300 ms apart.
    base, reqs = (random_requests(6, 300, 24, vocab_size=1000, seed=s) for s in (2, 3))
    cfg = SlowdownConfig(slowdown_ms=300, release_at_batch=7, stall_s=1.5)
    result = await slowdown_experiment(Endpoint(mesh.url, model=mesh.model_name), base, reqs, cfg)
    slowed = result["slowdown"]
    assert (slowed["release_reason"], slowed["batch_at_release"]) == ("stalled", 6)
    release = slowed["release_s"]
    for r in slowed["records"]:
        decoded = r.chunk_times[1:]  # the first token is the prefill worker's, before any decode step
        held = [b - a for a, b in zip(decoded, decoded[1:], strict=False) if b <= release]
        assert len(held) >= 2 and min(held) >= 0.25, held  # slowed: every step waited ~300 ms
        assert r.completion_tokens == 24
    assert slowed["full_batch"]["itl_ms"]["median"] < 250  # released: steps at full speed
