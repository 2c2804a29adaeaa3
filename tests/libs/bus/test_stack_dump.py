"""A running service prints every thread's Python stack to its log on SIGUSR1 and keeps serving (how the GPU
mesh benchmark learns where a stuck request waits before it stops a failed attempt)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from libs.natsd import start_nats_server


@pytest.fixture
def nats_url() -> Iterator[str]:
    server = start_nats_server()  # the kv-broker keeps its records in JetStream
    try:
        yield server.url
    finally:
        server.stop()


def _lines(proc: subprocess.Popen) -> queue.Queue[str | None]:
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            out.put(line)
        out.put(None)  # the process closed its stderr (it exited)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_for(lines: queue.Queue[str | None], text: str, timeout: float = 60.0) -> str:
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=timeout)  # the deadline of each line: a silent service fails the test
        except queue.Empty:
            line = None
        if line is None:
            raise AssertionError(f"no {text!r} in the service's output; got:\n{''.join(seen)[-3000:]}")
        seen.append(line)
        if text in line:
            return "".join(seen)


def test_sigusr1_dumps_every_threads_stack_and_the_service_runs_on(nats_url: str) -> None:
    env = {**os.environ, "MOEMESH_NATS_URL": nats_url, "MOEMESH_KV_BROKER_HTTP_PORT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kv_broker"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = _lines(proc)
        _wait_for(lines, " ready (nats ")
        proc.send_signal(signal.SIGUSR1)
        dump = _wait_for(
            lines, 'File "'
        )  # faulthandler: "Thread 0x... (most recent call first):" then frames
        assert "(most recent call first)" in dump
        assert proc.poll() is None  # still running
        proc.send_signal(signal.SIGINT)
        _wait_for(lines, " stopped")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
