"""Start and stop a local `mooncake_master` (the Mooncake Store's master) for `moemesh up --kv-store`. The kernel
picks its RPC port (`--rpc_port 0`), read back from the process's listening sockets: no pick-then-bind race.
`argv(port)` is the command that starts it again on the same port (the supervisor's restart)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from libs.natsd.server import stop_child

BINARY_ENV = "MOEMESH_MOONCAKE_MASTER_BIN"


class MooncakeMasterError(RuntimeError):
    """The binary could not be found, exited early or did not listen in time."""


def find_mooncake_master_binary() -> str:
    """$MOEMESH_MOONCAKE_MASTER_BIN, the Mooncake wheel's own binary, or mooncake_master on PATH."""
    override = os.environ.get(BINARY_ENV)
    if override:
        return override
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "mooncake_master"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise MooncakeMasterError(
        "mooncake_master not found: install the Mooncake wheel (mooncake-transfer-engine-non-cuda) or set "
        f"{BINARY_ENV}"
    )


def argv(host: str, port: int, metrics_port: int = 0) -> list[str]:
    """The master's command line: RPC on host:port, admin/metrics on host:metrics_port (0: the kernel picks)."""
    return [
        find_mooncake_master_binary(), f"--rpc_address={host}", f"--rpc_port={port}", f"--port={port}",
        f"--metrics_host={host}", f"--metrics_port={metrics_port}", "--rpc_thread_num=2",
    ]  # fmt: skip


class MooncakeMaster:
    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: Path, workdir: str) -> None:
        self.proc, self.host, self.port, self.log_path = proc, host, port, log_path
        self._workdir = workdir

    @property
    def address(self) -> str:
        """host:port, what a store client's master_server_addr is."""
        return f"{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        stop_child(self.proc, self._workdir, timeout)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_mooncake_master(
    host: str = "127.0.0.1", port: int = 0, ready_timeout: float = 15.0, prefix: Sequence[str] = ()
) -> MooncakeMaster:
    """Start the master and return once its RPC port accepts connections; `prefix` runs it under another
    command (`ip netns exec NS`, which execs: the pid is the master's)."""
    workdir = tempfile.mkdtemp(prefix="moemesh-mooncake-")
    log_path = Path(workdir) / "mooncake-master.log"
    with open(log_path, "wb") as log:  # its own session: the launcher stops it after the workers
        proc = subprocess.Popen(
            [*prefix, *argv(host, port)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        bound = _wait_listening(proc, host, port, log_path, time.monotonic() + ready_timeout)
    except BaseException:
        stop_child(proc, workdir, timeout=0)
        raise
    return MooncakeMaster(proc, host, bound, log_path, workdir)


def _wait_listening(proc: subprocess.Popen, host: str, port: int, log_path: Path, deadline: float) -> int:
    delay = 0.005
    while True:
        if proc.poll() is not None:
            raise MooncakeMasterError(
                f"mooncake_master exited with code {proc.returncode}:\n{_tail(log_path)}"
            )
        rpc = port or _rpc_port(proc.pid, log_path)
        if rpc and _accepts(host, rpc):
            return rpc
        if time.monotonic() > deadline:
            raise MooncakeMasterError(
                f"mooncake_master not listening before the deadline:\n{_tail(log_path)}"
            )
        time.sleep(delay)  # a child process: nothing to wait on but its sockets
        delay = min(delay * 2, 0.05)


def _rpc_port(pid: int, log_path: Path) -> int | None:
    """The RPC port of a master started on port 0: its listening port other than the admin one it logged."""
    admin = re.search(r"admin server started on port (\d+)", _tail(log_path, 1 << 16))
    if admin is None:
        return None
    ports = listening_ports(pid) - {int(admin.group(1))}
    return ports.pop() if len(ports) == 1 else None


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on (Linux /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, n: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""
