"""bench.loadgen_cost's fake server, as the benchmark runs it (its own process): the gateway's chunks, one per
step to every open stream, then usage and [DONE]; both clients read the same records from it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from libs.loadgen.client import Endpoint, HttpxClient, StreamClient, run_clock
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.raw_client import RawClient


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    cmd = [sys.executable, "-m", "bench.loadgen_cost", "--serve", "--step-ms", "2"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        yield f"http://127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.terminate()
        server.wait()


@pytest.mark.parametrize("kind", ["raw", "httpx"])
async def test_the_fake_server_streams_what_was_asked(fake_url: str, kind: str) -> None:
    ep = Endpoint(fake_url, model="fake", chunk_logprobs=True)
    client: StreamClient = RawClient(fake_url) if kind == "raw" else HttpxClient(4)
    clock = run_clock()
    try:
        recs = [await client.send(ep, BenchRequest([1, 2], 2, n), i, clock) for i, n in enumerate((7, 1, 30))]
    finally:
        await client.aclose()
    assert [(r.ok, r.completion_tokens, sum(r.chunk_tokens)) for r in recs] == [
        (True, 7, 7),
        (True, 1, 1),
        (True, 30, 30),
    ]
    times = recs[2].chunk_times
    assert times[-1] - times[0] > 0.04  # paced: 29 steps of 2 ms (the ticker catches up, never runs ahead)
