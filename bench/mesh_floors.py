"""What this machine charges the mesh's parts before any moemesh code runs: the floors under bench.mesh_ttft.

    python -m bench.mesh_floors [--n 300] [--event-loop asyncio|uvloop] [--parts http,bus]
                                [--out bench/results/mesh_floors.json]

Not the product's code, on purpose: the libraries the services are built on, measured bare, so the mesh's own
share of TTFT can be read against them.
1. HTTP: a bare FastAPI app on uvicorn (its own process, TCP_NODELAY as the gateway binds) answering a
   streaming POST with one SSE chunk, timed from httpx like bench.mesh_ttft: back to back, and with 10 ms idle
   before each request (the VM's wake-up cost).
2. The bus: nats-py request/reply between two processes through a nats-server (one-way ~ half of it).
3. Mooncake TCP: one 8 MiB write between two processes, and the longest stall of a Python thread running
   beside it (the binding holds the GIL for part or all of the call).
4. The engine: one tiny-model prefill step (5 and 40 tokens) back to back, after 10 ms idle (asleep), and after
   0.5, 2 and 10 ms of busy-spinning (whether the step slows with the gap itself or with the core's idle state).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from starlette.responses import StreamingResponse

from libs.bus.loop import run as run_loop
from libs.loadgen.report import write_json

IDLE_S = 0.010
# the engine step after this long busy-spinning: does it slow with the gap itself, asleep or not?
SPIN_MS = (0.5, 2.0, 10.0)
PARTS = ("http", "bus", "mooncake_tcp", "engine")


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _serve_sse(loop: str) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        await request.json()

        async def events():
            yield b'data: {"text":"x"}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    cfg = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    run_loop(uvicorn.Server(cfg).serve(sockets=[sock]), loop)


def _peer(role: str, *args: str) -> tuple[subprocess.Popen, str]:
    """This module as a child process in `role`; returns it and the first line it prints (its address)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.mesh_floors", "--role", role, *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise RuntimeError(f"the {role} child printed nothing (exit {proc.wait()})")
    return proc, line


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_floor(n: int, loop: str = "asyncio") -> dict:
    proc, port = _peer("http", loop)
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "stream": True}
    try:
        with httpx.Client(timeout=10) as h:
            deadline = time.monotonic() + 30
            while True:  # the server is up once it answers
                try:
                    h.post(url, json=body)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

            def one() -> float:
                t0 = time.perf_counter()
                with h.stream("POST", url, json=body) as r:
                    for line in r.iter_lines():
                        if '"text"' in line:
                            return (time.perf_counter() - t0) * 1e3
                raise RuntimeError("no SSE chunk")

            hot = [one() for _ in range(n)]
            idle = []
            for _ in range(n):
                time.sleep(IDLE_S)
                idle.append(one())
    finally:
        _stop(proc)
    return {"ttft_p50_ms_back_to_back": _p50(hot), "ttft_p50_ms_after_idle": _p50(idle)}


def _echo(url: str, loop: str) -> None:
    import nats

    async def main() -> None:
        nc = await nats.connect(url)

        async def h(msg) -> None:
            await nc.publish(msg.reply, msg.data)

        await nc.subscribe("floor.echo", cb=h)
        await nc.flush()
        print("ready", flush=True)
        await asyncio.Event().wait()  # until terminated

    run_loop(main(), loop)


def bus_floor(n: int, loop: str = "asyncio") -> dict:
    import nats

    from libs.natsd import start_nats_server

    server = start_nats_server(jetstream=False)
    proc, _ = _peer("echo", server.url, loop)
    try:

        async def rtts() -> list[float]:
            nc = await nats.connect(server.url)
            out = []
            for _ in range(n + 20):
                t0 = time.perf_counter()
                await nc.request("floor.echo", b"x" * 100, timeout=2)
                out.append((time.perf_counter() - t0) * 1e3)
            await nc.close()
            return out[20:]

        xs = run_loop(rtts(), loop)
    finally:
        _stop(proc)
        server.stop()
    return {"request_reply_p50_ms": _p50(xs), "one_way_p50_ms_estimate": _p50(xs) / 2}


def _mooncake_peer() -> None:
    import torch

    from libs.kvtransfer.mooncake import MooncakeTransport

    t = MooncakeTransport("tcp")
    buf = torch.zeros(16 << 20, dtype=torch.uint8)
    t.register(buf.data_ptr(), buf.numel())
    print(t.session_id, buf.data_ptr(), flush=True)
    threading.Event().wait()  # until terminated


def mooncake_floor() -> dict:
    import torch

    from libs.kvtransfer.mooncake import MooncakeTransport

    proc, line = _peer("mooncake")
    try:
        session, base_s = line.split()
        base = int(base_s)
        t = MooncakeTransport("tcp")
        src = torch.ones(16 << 20, dtype=torch.uint8)
        t.register(src.data_ptr(), src.numel())
        engine = t._live_engine()  # one call of 8 MiB: the binding itself, not MooncakeTransport's batching

        def write() -> None:
            engine.batch_transfer_sync_write(session, [src.data_ptr()], [base], [8 << 20])

        write()
        t0 = time.perf_counter()
        write()
        write_ms = (time.perf_counter() - t0) * 1e3
        done, gaps = threading.Event(), []

        def writer() -> None:
            for _ in range(10):
                write()
            done.set()

        th = threading.Thread(target=writer)
        last = time.perf_counter()
        th.start()
        while not done.is_set():  # Python work beside the writes: how long is the GIL away at a time
            sum(range(200))
            now = time.perf_counter()
            gaps.append((now - last) * 1e3)
            last = now
        th.join()
        t.close()
    finally:
        _stop(proc)
    return {"write_8mib_ms": write_ms, "longest_python_stall_ms_beside_writes": max(gaps)}


def engine_floor(n: int) -> dict:
    import torch

    from libs.engine import Engine, SamplingParams
    from libs.engine.tiny import write_tiny_model

    torch.set_num_threads(1)
    model = write_tiny_model(Path(f"/tmp/moemesh-floors-{os.getpid()}"), overwrite=True)
    engine = Engine.from_pretrained(model, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for plen in (5, 40):

        def step(i: int, plen: int = plen) -> float:
            rid = f"r{plen}-{i}"
            t0 = time.perf_counter()
            engine.add_prefill(rid, [(i * 31 + 7 * j) % 1000 + 3 for j in range(plen)], params)
            engine.step()
            dt = (time.perf_counter() - t0) * 1e3
            engine.release(rid)
            return dt

        for i in range(10):
            step(i)
        # interleaved, the order reversed every other round: each mode sees the same moments of the box
        gaps = {"back_to_back": lambda: None, "after_idle": lambda: time.sleep(IDLE_S)}
        gaps |= {f"after_spin_{ms:g}ms": functools.partial(_spin, ms / 1e3) for ms in SPIN_MS}
        times: dict[str, list[float]] = {k: [] for k in gaps}
        for i in range(n):
            for k in list(gaps) if i % 2 else list(gaps)[::-1]:
                gaps[k]()
                times[k].append(step(100 + i * len(gaps) + len(times[k])))
        out[f"prefill_{plen}_tokens"] = {f"step_p50_ms_{k}": _p50(v) for k, v in times.items()}
    return out


def _spin(seconds: float) -> None:
    """Busy the core for `seconds` (no sleep: its idle state never entered)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="samples per measurement")
    ap.add_argument("--out", default="bench/results/mesh_floors.json")
    ap.add_argument(
        "--event-loop", default="asyncio", choices=("asyncio", "uvloop"),
        help="the loop of the HTTP server, the echo peer and the bus client (the services' event_loop)",
    )  # fmt: skip
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)  # a child process of this benchmark
    ap.add_argument("--parts", default=",".join(PARTS), help="which floors to measure, comma-separated")
    args = ap.parse_args()
    if args.role:
        role, *rest = args.role
        peers: dict[str, Callable[..., None]] = {
            "http": _serve_sse,
            "echo": _echo,
            "mooncake": _mooncake_peer,
        }
        peers[role](*rest)
        return
    rec = {"benchmark": "mesh_floors", "machine": platform.node(), "cpus": os.cpu_count(),
           "command": "python -m bench.mesh_floors " + " ".join(sys.argv[1:]), "load_avg_before": os.getloadavg(),
           "idle_s": IDLE_S, "event_loop": args.event_loop}  # fmt: skip
    loop = args.event_loop
    for name, fn in (("http", lambda: http_floor(args.n, loop)), ("bus", lambda: bus_floor(args.n, loop)),
                     ("mooncake_tcp", mooncake_floor), ("engine", lambda: engine_floor(args.n // 3 or 1))):  # fmt: skip
        if name not in args.parts.split(","):
            continue
        rec[name] = fn()
        print(name, rec[name], flush=True)
    rec["load_avg_after"] = os.getloadavg()
    print(f"wrote {write_json(args.out, rec)}")


if __name__ == "__main__":
    main()
