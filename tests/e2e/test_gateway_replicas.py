"""Two gateway replicas (`moemesh up --gateways 2`) on one API port (SO_REUSEPORT), sim workers: streams
spread over both with the SimEngine's text; a replica killed mid-stream ends only its own streams (with an
error, none hangs), and the supervisor brings it back on the same port, where it serves again."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.bus.ports import read_ports
from libs.chaos import metric_total, stream_many
from libs.chaos.load import Progress
from libs.engine import SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from libs.launch.restart_policy import RestartPolicy
from libs.sim import SimEngine
from tests.e2e.conftest import assert_no_leaks, workers_env

pytestmark = pytest.mark.e2e

N, MAX_TOKENS = 24, 32
RECEIVED = 'moemesh_gateway_requests_received_total{endpoint="completions"}'
PROMPTS = [[(13 * i + 7 * k) % 500 + 3 for k in range(4 + i % 20)] for i in range(N)]


@pytest.fixture(scope="module")
def two_gateways(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    worker = {"ENGINE": "sim", "SIM_SPEED": "0.25"}  # ~40 ms decode steps: a stream lasts over a second
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, gateways=2, prefill_workers=1, decode_workers=1,
        transfer_protocol="skip", log_dir=tmp_path_factory.mktemp("gateways-logs"),
        restart=RestartPolicy(backoff_s=0.2),
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "12"},
            **workers_env(worker),
        },
    )  # fmt: skip
    with Mesh(cfg) as m:
        yield m
        assert_no_leaks(m)


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> list[str]:
    engine = SimEngine.from_checkpoint(tiny_model)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.text for o in outs]


def received(mesh: Mesh) -> list[float]:
    """Completions each replica took on, from its own /metrics (its side port)."""
    return [metric_total(url, RECEIVED) for url in mesh.gateway_metrics_urls()]


def side_ready(mesh: Mesh, name: str) -> dict | None:
    """The replica's own /ready body when it answers 200 (None while it does not)."""
    ports = read_ports(mesh.ports_file(name))
    if ports is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/ready", timeout=1) as r:
            return json.load(r)
    except (OSError, urllib.error.HTTPError):
        return None


def test_streams_spread_over_both_replicas_with_the_sim_engines_text(
    two_gateways: Mesh, want: list[str]
) -> None:
    mesh = two_gateways
    assert mesh.gateway_names() == ["gateway-0", "gateway-1"]
    ports = [read_ports(mesh.ports_file(n)) for n in mesh.gateway_names()]
    assert all(p is not None and p["api"] == mesh.port for p in ports), ports  # one API port, one URL
    assert ports[0]["http"] != ports[1]["http"]  # type: ignore[index]
    ids = {(side_ready(mesh, n) or {}).get("instance") for n in mesh.gateway_names()}
    assert len(ids) == 2 and None not in ids  # each its own bus id, so its own token stream

    before = received(mesh)
    outs = asyncio.run(stream_many(mesh.url, mesh.model_name, PROMPTS, MAX_TOKENS))  # a connection each
    assert [o.text for o in outs] == want, [o.error for o in outs]
    assert all(o.finish_reason == "length" and o.completion_tokens == MAX_TOKENS for o in outs)
    took = [a - b for a, b in zip(received(mesh), before, strict=True)]
    assert sum(took) == N and min(took) > 0, took  # the kernel spread the connections over both


def test_a_killed_replica_ends_only_its_streams_and_comes_back_on_the_same_port(
    two_gateways: Mesh, want: list[str]
) -> None:
    mesh = two_gateways
    # gateway-0: it was started on port 0 and bound the port first, so its restart must be pinned to it
    before, restarts = received(mesh), mesh.sup.restarts("gateway-0")
    struck: dict[str, float] = {}

    async def strike(progress: Progress) -> None:
        assert await progress.wait(N, 2, timeout=60), "the streams never got going"
        struck["finished"] = progress.finished()
        struck["on_0"] = (await asyncio.to_thread(received, mesh))[0] - before[0]
        await asyncio.to_thread(mesh.sup.kill, "gateway-0")

    outs = asyncio.run(
        stream_many(mesh.url, mesh.model_name, PROMPTS, MAX_TOKENS, deadline_s=60, fault=strike)
    )
    assert struck["finished"] == 0, struck  # it struck while every stream was running
    ok = [o for o in outs if o.ok]
    assert not any(o.hung for o in outs)
    assert 0 < struck["on_0"] == N - len(ok), (struck, [o.error for o in outs])  # only the dead one's
    assert all(o.text == want[o.index] for o in ok)  # the survivor's streams finished undisturbed

    mesh.wait_restarted("gateway-0", restarts + 1, timeout=60)
    deadline = time.monotonic() + 60
    while side_ready(mesh, "gateway-0") is None:  # it must hear a decode worker and a scheduler first
        assert time.monotonic() < deadline, f"gateway-0 restarted but not ready; logs in {mesh.log_dir}"
        time.sleep(0.1)  # another process comes up: poll its /ready
    assert read_ports(mesh.ports_file("gateway-0"))["api"] == mesh.port  # type: ignore[index]
    before = received(mesh)
    outs = asyncio.run(stream_many(mesh.url, mesh.model_name, PROMPTS, MAX_TOKENS))
    assert [o.text for o in outs] == want, [o.error for o in outs]
    took = [a - b for a, b in zip(received(mesh), before, strict=True)]
    assert sum(took) == N and min(took) > 0, took  # the restarted replica takes its share again
