"""Start, watch and stop the mesh's service processes (`python -m services.<name>`).

Used by `moemesh up` and by the e2e tests. Each child gets its own log file and its own process group,
so a stop reaches whatever it spawned (e.g. EP ranks). Stopping is SIGTERM (the services drain), then
SIGKILL after a grace period. A spec's ports file is removed before each start, so what is read from
it afterwards comes from the process now running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# A test process runs Triton in interpreter mode on CPU machines; a service decides its kernels for itself.
NOT_INHERITED = frozenset({"TRITON_INTERPRET"})


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # unique per mesh, e.g. "decode-worker-0"
    module: str  # e.g. "services.decode_worker"
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    ports_file: Path | None = None  # where the service writes the ports it bound (libs.bus.ports)


class ServiceProcess:
    def __init__(self, spec: ServiceSpec, proc: subprocess.Popen, log_path: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait()


class Supervisor:
    """Owns a set of service processes; `stop_all` ends them in reverse start order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, ServiceProcess] = {}

    def start(self, spec: ServiceSpec) -> ServiceProcess:
        if spec.name in self.procs and self.procs[spec.name].alive:
            raise ValueError(f"service {spec.name} is already running")
        log_path = self.log_dir / f"{spec.name}.log"
        if spec.ports_file is not None:  # a previous life's ports are not this one's
            spec.ports_file.unlink(missing_ok=True)
        inherited = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", spec.module, *spec.args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        sp = ServiceProcess(spec, proc, log_path)
        self.procs[spec.name] = sp
        return sp

    def restart(self, name: str, grace_s: float = 10.0) -> ServiceProcess:
        old = self.procs[name]
        old.stop(grace_s)
        return self.start(old.spec)

    def kill(self, name: str) -> None:
        """Hard kill (SIGKILL), as a crash would."""
        p = self.procs[name]
        p.signal(signal.SIGKILL)
        p.proc.wait()

    def dead(self) -> list[ServiceProcess]:
        return [p for p in self.procs.values() if not p.alive]

    def check_alive(self) -> None:
        """Raise with the log tail of the first service that exited."""
        for p in self.dead():
            raise RuntimeError(
                f"service {p.spec.name} exited with code {p.proc.returncode}; log tail:\n{p.log_tail()}"
            )

    def stop_all(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in reversed(list(self.procs.values())):
            p.signal(signal.SIGTERM)
        for p in reversed(list(self.procs.values())):
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.signal(signal.SIGKILL)
                p.proc.wait()
