"""A run's requests split over client processes (`moemesh bench --client-procs N`), merged into one run."""

# One asyncio process streams at most 1/(CPU per event) events/s, so a server faster than that is measured
# as slow as its client. `ClientProcs` starts N children
# (`python -m libs.loadgen.procs SPEC OUT`, the spec a JSON file: no pickled arguments), deals request i to
# child i % N with its arrival time from the one schedule of the run and 1/N of the concurrency limit, and
# waits until every child says it is ready; `run(t0)` then sends each the run's clock base and start time,
# counts their finished requests (one line each on stdout) and merges their records (a JSON file each) in
# request order. Times are seconds of time.monotonic (CLOCK_MONOTONIC: one clock for every process of the
# machine) minus t0, so the children's chunk times line up with the parent's own clock (the slow-down
# release). The parent keeps everything else: warm-up, admin calls, the summary.

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from libs.bus import loop
from libs.loadgen.client import Endpoint, run_clock
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.sending import open_client, stream_items
from libs.loadgen.stats import RequestRecord


class Item(msgspec.Struct, frozen=True, array_like=True):
    index: int
    arrival_s: float  # offset from the run's start
    prompt: str | list[int]
    input_len: int
    output_len: int


class Share(msgspec.Struct, frozen=True):
    """One child's part of a run: where to send, with which client, its requests and concurrency."""

    base_url: str
    backend: str
    model: str
    api_key: str
    extra_body: dict[str, Any]
    chunk_logprobs: bool
    chunk_usage: bool
    client: str
    event_loop: str
    max_concurrency: int | None
    items: list[Item]


def deal(
    requests: Sequence[BenchRequest], arrivals: Sequence[float], concurrency: int | None, procs: int
) -> list[tuple[int | None, list[Item]]]:
    """(concurrency, items) per child: request i to child i % n; the limit split as evenly as it goes.
    Fewer children than asked when there are fewer requests (or a lower limit) than processes."""
    if procs < 1:
        raise ValueError(f"client processes must be >= 1, got {procs}")
    n = max(1, min(procs, len(requests), concurrency or len(requests)))
    items = [
        Item(i, a, r.prompt, r.input_len, r.output_len)
        for i, (r, a) in enumerate(zip(requests, arrivals, strict=True))
    ]
    limits = [None if concurrency is None else concurrency // n + (k < concurrency % n) for k in range(n)]
    return [(limits[k], items[k::n]) for k in range(n)]


class ClientProcs:
    """The children of one run (an async context manager: they are stopped on the way out)."""

    def __init__(
        self, ep: Endpoint, client: str, event_loop: str, shares: list[tuple[int | None, list[Item]]]
    ) -> None:
        self.ep, self.client, self.event_loop, self.shares = ep, client, event_loop, shares
        self.procs: list[asyncio.subprocess.Process] = []
        self.dir = tempfile.TemporaryDirectory(prefix="moemesh-bench-")

    async def __aenter__(self) -> ClientProcs:
        try:
            for k, (limit, items) in enumerate(self.shares):
                ep = self.ep
                share = Share(ep.base_url, ep.backend, ep.model, ep.api_key, ep.extra_body, ep.chunk_logprobs,
                              ep.chunk_usage, self.client, self.event_loop, limit, items)  # fmt: skip
                spec = Path(self.dir.name) / f"share-{k}.json"
                spec.write_bytes(msgspec.json.encode(share))
                self.procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "libs.loadgen.procs",
                        str(spec),
                        str(self._out(k)),
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                    )  # fmt: skip
                )
            for k, p in enumerate(self.procs):
                assert p.stdout is not None
                if (await p.stdout.readline()).strip() != b"ready":
                    raise RuntimeError(
                        f"client process {k} exited before it was ready (code {await p.wait()})"
                    )
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    def _out(self, k: int) -> Path:
        return Path(self.dir.name) / f"records-{k}.json"

    async def run(self, t0: float, on_done: Callable[[], None] | None = None) -> list[RequestRecord]:
        """Start every child now; records of all requests, in request order, on the clock of base t0."""
        go = f"{t0!r} {time.monotonic()!r}\n".encode()
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(go)
                await p.stdin.drain()
            await asyncio.gather(*(self._follow(k, p, on_done) for k, p in enumerate(self.procs)))
        except BaseException:
            await self._stop()  # cancelled (the slow-down watch failed) or a child failed: stop the rest
            raise
        decoder = msgspec.json.Decoder(list[RequestRecord])
        records = [r for k in range(len(self.procs)) for r in decoder.decode(self._out(k).read_bytes())]
        return sorted(records, key=lambda r: r.index)

    async def _follow(
        self, k: int, p: asyncio.subprocess.Process, on_done: Callable[[], None] | None
    ) -> None:
        assert p.stdout is not None
        while await p.stdout.readline():
            if on_done is not None:
                on_done()
        if (rc := await p.wait()) != 0:
            raise RuntimeError(f"client process {k} failed with exit code {rc} (its stderr is above)")

    async def _stop(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.kill()
            await p.wait()
        self.procs = []
        self.dir.cleanup()


async def _child(share: Share, t0: float, start: float) -> list[RequestRecord]:
    ep = Endpoint(share.base_url, share.backend, share.model, share.api_key, share.extra_body,
                  share.chunk_logprobs, share.chunk_usage)  # fmt: skip
    clock = run_clock(t0)
    items = [
        (it.index, it.arrival_s, BenchRequest(it.prompt, it.input_len, it.output_len)) for it in share.items
    ]
    client = open_client(share.client, ep.base_url, share.max_concurrency or len(items))

    def done(_: RequestRecord) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()

    try:
        return await stream_items(client, ep, items, share.max_concurrency, clock, start - t0, done)
    finally:
        await client.aclose()


def main(argv: Sequence[str]) -> int:
    spec, out = argv
    share = msgspec.json.decode(Path(spec).read_bytes(), type=Share)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    t0, start = (float(x) for x in sys.stdin.readline().split())
    records = loop.run(_child(share, t0, start), share.event_loop)
    Path(out).write_bytes(msgspec.json.encode(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
