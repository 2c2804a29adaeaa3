"""`moemesh up` itself, as a user runs it (a subprocess of the CLI): a service that crashes at start-up
over and over is given up on after the restart limit, loudly (its exit code and log tail printed), the
rest of the mesh still serves, the gateway's /metrics says which service was given up on, and Ctrl-C
still drains and stops everything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libs.launch.supervisor import stop_group

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 240.0


class Console:
    """The launcher's stdout, line by line, from a reader thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.lines.append("<eof>")
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(rx.search(x) for x in self.lines) or "<eof>" in self.lines, timeout
            )
            found = next((mt for x in self.lines if (mt := rx.search(x))), None)
        assert ok and found, f"no {pattern!r} in the launcher's output:\n{self.text}"
        return found

    @property
    def text(self) -> str:
        return "".join(self.lines)


def mesh_processes(nats_url: str) -> list[int]:
    """Pids of the processes serving this mesh: services (their MOEMESH_NATS_URL) and its nats-server."""
    port = nats_url.rsplit(":", 1)[1]
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        nats = b"nats-server" in argv[0] and port.encode() in argv
        if nats or f"MOEMESH_NATS_URL={nats_url}".encode() in environ:
            found.append(int(proc.name))
    return found


@pytest.fixture
def up_with_a_broken_prefill_worker(
    tiny_model: Path, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen, Console]]:
    # a prefill-only setting (up checks the settings both workers share before it starts anything)
    env = {**os.environ, "MOEMESH_PREFILL_WORKER_MAX_PREFILL_PROMPTS": "-1"}  # every prefill-worker start fails
    cmd = [
        sys.executable, "-m", "libs.cli.main", "up", "--model", str(tiny_model), "--port", "0",
        "--prefill-workers", "1", "--decode-workers", "1", "--log-dir", str(tmp_path / "logs"),
        "--restart-backoff", "0.2", "--restart-limit", "2", "--restart-window", "120",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        yield proc, Console(proc)
    finally:
        # the test failed before its Ctrl-C: stop the launcher and its children (a no-op once it exited)
        stop_group(proc, signal.SIGINT, 60)


def test_a_service_crashing_at_start_up_is_given_up_while_the_rest_serves(
    up_with_a_broken_prefill_worker,
) -> None:
    proc, console = up_with_a_broken_prefill_worker
    up = console.wait_for(r"moemesh is up: (http://\S+)/v1 .*nats (nats://\S+)\)", START_TIMEOUT_S)
    url, nats_url = up.group(1), up.group(2)
    assert mesh_processes(nats_url), "no service process found"
    out = console.text
    # two restarts allowed, the third exit gives it up: three starts, each exit printed with its log tail
    assert out.count("prefill-0 exited with code 2") == 3, out
    assert out.count("prefill-0 restarted") == 2, out
    give_up = out[out.index("prefill-0 exited with code 2; GIVING UP") :]
    assert "(from MOEMESH_PREFILL_WORKER_MAX_PREFILL_PROMPTS='-1')" in give_up, out  # its log tail says why
    assert "given up: prefill-0" in out, out

    # the rest serves: the prompt is prefilled on the decode worker
    body = {
        "model": "tiny-v3",
        "prompt": list(range(3, 40)),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8

    deadline = time.monotonic() + 10
    want = re.compile(r'moemesh_launcher_service_status\{[^}]*service="prefill-0",status="given_up"\} 1\.0')
    while not want.search(metrics := httpx.get(f"{url}/metrics", timeout=10).text):
        assert time.monotonic() < deadline, metrics
        time.sleep(0.2)  # the launcher publishes its status every second
    assert re.search(r'service="decode-0",status="up"\} 1\.0', metrics), metrics

    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the launcher's terminal
    assert proc.wait(90) == 0, console.text
    console.wait_for("stopping moemesh", 5)
    assert mesh_processes(nats_url) == [], "processes of the mesh outlived the launcher"
    print(console.text)  # with -s: what a user sees
