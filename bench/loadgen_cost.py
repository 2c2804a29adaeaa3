"""What `moemesh bench`'s own client costs per streamed token, and the token rate it can drive, per client.

    python -m bench.loadgen_cost [--concurrency 256 --step-ms 20,5 --clients httpx:1:asyncio,raw:2:uvloop]
                                 [--out bench/results/loadgen_cost.json]

A fake OpenAI completions server (its own process, `--serve`) streams to every open request one event per
step, as a decode worker's batch does: the gateway's own chunk bytes (services.gateway.formatting, with a
logprobs entry as the slow-down experiment asks), then the usage chunk and [DONE]. `moemesh bench` runs
against it as a user runs it (its own process, `--client`, `--client-procs`, `--event-loop`), every request at once at
the given concurrency. The client's CPU is its process tree's (getrusage of waited children); per token it
is the difference between a long and a short run (--long, --short output tokens) over the difference in
tokens, so imports, start-up and per-request work cancel out. The server offers concurrency / step tokens/s;
`output_tok_s` says how much of it the client took in. The machine is shared: its load average is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from bench.scale_load import cpu_seconds
from libs.loadgen.report import write_json

_LENGTH = re.compile(rb"content-length:\s*(\d+)")
_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')


def _frames() -> tuple[bytes, bytes]:
    """(response head, one token's event as an HTTP/1.1 chunk)."""
    from services.gateway.formatting import LogprobEntry, completion_chunk, sse

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    entry = LogprobEntry(token=" the", bytes=[32, 116, 104, 101], logprob=-0.25)
    token = sse(completion_chunk("cmpl-0123456789abcdef", 1764633600, "fake", 0, " the", logprobs=[entry],
                                 with_usage_field=True))  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head, chunk(token)


class _Conn(asyncio.Protocol):
    """One client connection of the fake server: requests in, one event per tick out."""

    def __init__(self, active: set[_Conn], frames: tuple[bytes, bytes]) -> None:
        self.active, (self.head, self.token) = active, frames
        self.buf, self.left, self.total = b"", 0, 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        hit = _LENGTH.search(self.buf[:end].lower()) if end >= 0 else None
        if hit is None or len(self.buf) < end + 4 + int(hit.group(1)):
            return  # the request is not all in yet
        body = self.buf[end + 4 : end + 4 + int(hit.group(1))]
        self.buf = self.buf[end + 4 + int(hit.group(1)) :]
        tokens = _MAX_TOKENS.search(body)
        self.left = self.total = int(tokens.group(1)) if tokens else 16
        assert self.transport is not None
        self.transport.write(self.head)
        self.active.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.active.discard(self)

    def emit(self) -> None:
        assert self.transport is not None
        self.left -= 1
        if self.left > 0:
            self.transport.write(self.token)
            return
        usage = b'data: {"id":"cmpl-0","object":"text_completion","choices":[],"usage":{"prompt_tokens":16,'
        usage += b'"completion_tokens":%d,"total_tokens":%d}}\n\n' % (self.total, self.total + 16)
        end = usage + b"data: [DONE]\n\n"
        self.transport.write(self.token + b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
        self.active.discard(self)


async def serve(step_s: float) -> None:
    """Listen on a free loopback port (printed), and stream to every open request once per step."""
    frames, active = _frames(), set[_Conn]()
    loop = asyncio.get_running_loop()
    # A backlog for every client at once: with the default 100, the 256 connects of one run overflow it
    # and the dropped SYNs come back a second later, which the run would count as the client's time.
    server = await loop.create_server(lambda: _Conn(active, frames), "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    next_at = loop.time()
    while True:
        for conn in list(active):
            conn.emit()
        next_at += step_s
        await asyncio.sleep(max(next_at - loop.time(), 0))  # the decode step's period itself


def _client_run(
    url: str, client: tuple[str, int, str], concurrency: int, tokens: int, out: Path
) -> dict[str, Any]:
    kind, procs, loop = client
    cmd = [sys.executable, "-m", "libs.cli.main", "bench", "--base-url", url, "--model", "fake",
           "--client", kind, "--client-procs", str(procs), "--event-loop", loop, "--num-prompts", str(concurrency),
           "--max-concurrency", str(concurrency), "--random-input-len", "16", "--random-output-len", str(tokens),
           "--random-range-ratio", "1", "--warmup-requests", "0", "--disable-progress", "--output-file", str(out)]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads(out.read_text())["summary"]
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"cpu_s": user + system, "user_s": user, "sys_s": system, "tokens": summary["total_output_tokens"], "failed": summary["failed"],
            "output_tok_s": summary["output_throughput"], "itl_median_ms": summary["itl_ms"]["median"],
            "duration_s": summary["duration_s"]}  # fmt: skip


def _pair(
    url: str, client: tuple[str, int, str], step_ms: float, args: argparse.Namespace, tmp: Path
) -> dict:
    """One short and one long run of a client: its CPU per token between them, and the long run's rate."""
    short = _client_run(url, client, args.concurrency, args.short, tmp / "short.json")
    long = _client_run(url, client, args.concurrency, args.long, tmp / "long.json")
    tokens = max(long["tokens"] - short["tokens"], 1)
    per_token, sys_share = (
        (long["cpu_s"] - short["cpu_s"]) / tokens,
        (long["sys_s"] - short["sys_s"]) / tokens,
    )
    offered = args.concurrency * 1000 / step_ms
    print(f"step {step_ms:g} ms {client[0]} x{client[1]} on {client[2]}: {per_token * 1e6:.1f} us CPU/token "
          f"({sys_share * 1e6:.1f} in the kernel), {long['output_tok_s']:.0f} tok/s of {offered:.0f} offered, "
          f"median ITL {long['itl_median_ms']:.1f} ms, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    return {
        "client": client[0], "client_procs": client[1], "event_loop": client[2], "step_ms": step_ms,
        "concurrency": args.concurrency, "offered_tok_s": offered, "client_us_per_token": per_token * 1e6,
        "client_sys_us_per_token": sys_share * 1e6, "short": short, "long": long, "loadavg": os.getloadavg(),
    }  # fmt: skip


def measure(
    step_ms: float, clients: list[tuple[str, int, str]], args: argparse.Namespace, tmp: Path
) -> list[dict]:
    """Every client against one fake server of this step, --repeat rounds, the clients alternated."""
    server = subprocess.Popen([sys.executable, "-m", "bench.loadgen_cost", "--serve", "--step-ms", str(step_ms)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    rows = []
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        for rep in range(args.repeat):
            for client in clients:
                before = cpu_seconds(server.pid)
                row = _pair(url, client, step_ms, args, tmp)
                rows.append(row | {"round": rep, "server_cpu_s": cpu_seconds(server.pid) - before})
    finally:
        server.terminate()
        server.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help="run the fake server only (used by the benchmark)")
    ap.add_argument("--step-ms", default="20,5", help="the fake decode step(s): one event per stream each")
    ap.add_argument(
        "--clients",
        default="httpx:1:asyncio,httpx:1:uvloop,raw:1:asyncio,raw:1:uvloop,raw:2:uvloop",
        help="client:processes:event-loop triples to measure",
    )
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--short", type=int, default=20, help="output tokens of the short run")
    ap.add_argument("--long", type=int, default=200, help="output tokens of the long run")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every client (the box is shared)")
    ap.add_argument("--out", default="bench/results/loadgen_cost.json")
    args = ap.parse_args()
    steps = [float(x) for x in args.step_ms.split(",")]
    if args.serve:
        asyncio.run(serve(steps[0] / 1000))
        return
    clients = [(c, int(n), loop) for c, n, loop in (x.split(":") for x in args.clients.split(","))]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for step in steps for row in measure(step, clients, args, Path(tmp))]
    out = {
        "benchmark": "loadgen_cost",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },  # fmt: skip
        "method": "client CPU (process tree) of a long run minus a short one, over the tokens between them",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    print(f"results: {write_json(args.out, out)}")


if __name__ == "__main__":
    main()
