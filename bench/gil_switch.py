"""What a busy Python thread costs the event loop of the same process, by GIL switch interval: the case of a
worker service, whose engine thread runs the engine's host work (batching, stop checks, outputs) while the
event loop answers the bus. A child process pings the loop over a socket pair; each ping's round trip is
timed while a second thread of the loop's process spins in Python.

    python -m bench.gil_switch [--intervals-ms 5,0.5,0.1] [--pings 300]

Writes bench/results/gil_switch.json (round-trip percentiles per interval, the busy thread's progress
meanwhile, the machine's load). The worker
services set `gil_switch_interval_ms` (libs/worker/settings.py) from what this shows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from libs.loadgen.report import write_json


def _spin(stop: threading.Event, done: list[int]) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i
        done[0] += 1


def _pinger(sock: socket.socket, pings: int, gap_s: float) -> list[float]:
    times = []
    for _ in range(pings):
        t = time.perf_counter()
        sock.send(b"x")
        sock.recv(1)
        times.append(time.perf_counter() - t)
        time.sleep(gap_s)
    sock.send(b"q")
    return times


async def _echo(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    while (data := await loop.sock_recv(sock, 1)) != b"q":
        await loop.sock_sendall(sock, data)


def one_interval(interval_s: float, pings: int, busy: bool) -> dict[str, Any]:
    """Round trips (ms) to an event loop with (or without) a spinning thread beside it."""
    ours, theirs = socket.socketpair()
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the pinger: its own process, so its own GIL
        ours.close()
        os.close(rd)
        theirs.recv(1)  # the loop is up
        times = _pinger(theirs, pings, 0.002)
        os.write(wr, ",".join(f"{t:.9f}" for t in times).encode())
        os._exit(0)
    theirs.close()
    os.close(wr)
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop, done = threading.Event(), [0]
    spinner = threading.Thread(target=_spin, args=(stop, done), daemon=True)
    if busy:
        spinner.start()
    t0 = time.perf_counter()
    try:
        ours.setblocking(False)
        ours.send(b"s")
        asyncio.run(_echo(ours))
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        if busy:
            spinner.join()
        sys.setswitchinterval(old)
        os.waitpid(pid, 0)
        ours.close()
    with os.fdopen(rd, "rb") as f:
        times = sorted(float(t) * 1000 for t in f.read().decode().split(","))
    at = lambda q: round(times[min(len(times) - 1, int(q * len(times)))], 3)  # noqa: E731
    return {"interval_ms": interval_s * 1000, "busy_thread": busy, "pings": len(times),
            "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "busy_thread_loops_per_s": round(done[0] / wall) if busy else None}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals-ms", default="5,0.5,0.1")
    ap.add_argument("--pings", type=int, default=300)
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "gil_switch.json"))
    a = ap.parse_args(argv)
    intervals = [float(x) / 1000 for x in a.intervals_ms.split(",") if x]
    rec: dict[str, Any] = {"benchmark": "gil_switch", "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(),
                           "command": "python -m bench.gil_switch " + " ".join(argv or sys.argv[1:]),
                           "runs": [one_interval(intervals[0], a.pings, busy=False)]}  # fmt: skip
    for iv in intervals:
        rec["runs"].append(one_interval(iv, a.pings, busy=True))
    rec["load_avg_after"] = os.getloadavg()
    for r in rec["runs"]:
        print(f"switch {r['interval_ms']:g} ms, busy thread {r['busy_thread']}: round trip p50 {r['p50_ms']} ms, "
              f"p90 {r['p90_ms']}, p99 {r['p99_ms']}; the busy thread's loops/s {r['busy_thread_loops_per_s']}")  # fmt: skip
    write_json(a.output, rec)
    return rec


if __name__ == "__main__":
    main()
