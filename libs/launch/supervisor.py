"""Start, watch, restart and stop the mesh's service processes (`python -m services.<name>`, or any
command such as the embedded nats-server)."""

# Used by `moemesh up`, the e2e tests and the chaos benchmark alike (through libs.launch.mesh). Each child
# gets its own log file and its own process group, so a stop reaches whatever it spawned (e.g. EP ranks).
# `poll()` is the supervision step: a child that exited is restarted after its backoff or given up on, by
# the pure rule in libs.launch.restart_policy; it returns what happened, for the caller to print.
# Stopping is SIGTERM (the services drain), then SIGKILL after a grace period. A spec's ports file is
# removed before each start, so what is read from it afterwards comes from the process now running.

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from libs.launch import restart_policy as rp

LOG_TAIL_LINES = 20
# A test process runs Triton in interpreter mode on CPU machines; a service decides its kernels for itself.
NOT_INHERITED = frozenset({"TRITON_INTERPRET"})


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # unique per mesh, e.g. "decode-worker-0"
    module: str  # e.g. "services.decode_worker"; "" when `argv` is the command
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    ports_file: Path | None = None  # where the service writes the ports it bound (libs.bus.ports)
    argv: tuple[str, ...] = ()  # a command that is not a Python module (the nats-server binary)
    netns: str = ""  # a network namespace to run in (`ip netns exec`, which execs: the pid is the service's)

    def command(self) -> list[str]:
        cmd = list(self.argv) if self.argv else [sys.executable, "-m", self.module, *self.args]
        return netns_exec(self.netns) + cmd


def netns_exec(netns: str) -> list[str]:
    """The command prefix that runs a command in network namespace `netns` ("" for none)."""
    return ["ip", "netns", "exec", netns] if netns else []


class ServiceProcess:
    def __init__(self, spec: ServiceSpec, proc: subprocess.Popen, log_path: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        return stop_group(self.proc, signal.SIGTERM, grace_s)


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:
    """Send `sig` to the process group `proc` leads (started with start_new_session), wait up to grace_s,
    then SIGKILL the group; -> its exit code (None only if it had already been reaped elsewhere)."""
    for s in (sig, signal.SIGKILL):
        if proc.poll() is not None:
            return proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, s)
        try:
            return proc.wait(grace_s if s == sig else None)
        except subprocess.TimeoutExpired:
            continue
    return proc.returncode


class Supervisor:
    """Owns a set of service processes and restarts them by `policy`; `stop_all` ends them in reverse
    start order. Thread-safe: one thread polls while another kills (chaos) or stops (shutdown)."""

    def __init__(self, log_dir: Path, policy: rp.RestartPolicy | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.policy = policy or rp.RestartPolicy()
        self.procs: dict[str, ServiceProcess] = {}
        self.records: dict[str, rp.ServiceRecord] = {}
        self._lock = threading.RLock()
        self._stopping = False

    def start(self, spec: ServiceSpec) -> ServiceProcess:
        with self._lock:
            if spec.name in self.procs and self.procs[spec.name].alive:
                raise ValueError(f"service {spec.name} is already running")
            sp = self._launch(spec)
            self.records[spec.name] = rp.ServiceRecord(since=time.monotonic())
            return sp

    def adopt(self, spec: ServiceSpec, proc: subprocess.Popen, log_path: Path) -> ServiceProcess:
        """Supervise a process started elsewhere (in its own session); restarts run `spec`."""
        with self._lock:
            sp = self.procs[spec.name] = ServiceProcess(spec, proc, log_path)
            self.records[spec.name] = rp.ServiceRecord(since=time.monotonic())
            return sp

    def respec(self, name: str, spec: ServiceSpec) -> None:
        """Restarts of `name` run `spec` from now on (e.g. a gateway pinned to the port it first bound);
        the running process is left as it is."""
        with self._lock:
            if spec.name != name:
                raise ValueError(f"respec: {spec.name} is not {name}")
            self.procs[name].spec = spec

    def _launch(self, spec: ServiceSpec) -> ServiceProcess:
        log_path = self.log_dir / f"{spec.name}.log"
        if spec.ports_file is not None:  # a previous life's ports are not this one's
            spec.ports_file.unlink(missing_ok=True)
        inherited = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                spec.command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        sp = self.procs[spec.name] = ServiceProcess(spec, proc, log_path)
        return sp

    def poll(self, now: float | None = None) -> list[str]:
        """One supervision step: note exits, restart what is due. Returns lines for the operator."""
        lines: list[str] = []
        with self._lock:
            if self._stopping:
                return lines
            now = time.monotonic() if now is None else now
            for name, p in list(self.procs.items()):
                rec = self.records[name]
                if rec.state is rp.State.UP and not p.alive:
                    rec = self.records[name] = rp.on_exit(rec, self.policy, now, p.proc.returncode)
                    tail = p.log_tail().rstrip("\n")
                    lines.append(rp.describe_exit(name, rec, self.policy, now) + f"; log tail:\n{tail}")
                if rp.due(rec, now):
                    self._mark_restart(p, rec.restarts + 1)
                    new = self._launch(p.spec)
                    self.records[name] = rp.on_restarted(rec, now)
                    lines.append(f"{name} restarted (pid {new.proc.pid}, restart {rec.restarts + 1})")
        return lines

    def _mark_restart(self, p: ServiceProcess, n: int) -> None:
        log_path = self.log_dir / f"{p.spec.name}.log"
        with contextlib.suppress(OSError), open(log_path, "a") as f:
            f.write(f"--- moemesh supervisor: restart {n} of {p.spec.name} at {time.ctime()} ---\n")

    def kill(self, name: str) -> None:
        """Hard kill (SIGKILL), as a crash would; the next `poll` sees the exit."""
        p = self.procs[name]
        p.signal(signal.SIGKILL)
        p.proc.wait()

    def restarts(self, name: str) -> int:
        return self.records[name].restarts

    def state(self, name: str) -> rp.State:
        return self.records[name].state

    def given_up(self) -> list[str]:
        return [n for n, r in self.records.items() if r.state is rp.State.GIVEN_UP]

    def summary(self) -> str:
        """`8 up; restarting: decode-0; given up: none`."""
        with self._lock:
            by: dict[rp.State, list[str]] = {}
            for n, r in self.records.items():
                by.setdefault(r.state, []).append(n)
        up = len(by.get(rp.State.UP, []))
        names = lambda s: ", ".join(by.get(s, [])) or "none"  # noqa: E731
        return f"services: {up} up; restarting: {names(rp.State.RESTARTING)}; given up: {names(rp.State.GIVEN_UP)}"

    def stop_all(self, grace_s: float = 10.0, last: Sequence[str] = ()) -> None:
        """SIGTERM every service at once (they drain in parallel), those in `last` only after the rest
        exited (the nats-server: the others drain over it); SIGKILL what outlives the grace period."""
        with self._lock:
            self._stopping = True
            now = time.monotonic()
            for n, r in self.records.items():
                self.records[n] = rp.on_stopped(r, now)
        procs = list(reversed(list(self.procs.values())))
        first = [p for p in procs if p.spec.name not in last]
        self._stop_group(first, grace_s)
        self._stop_group([p for p in procs if p.spec.name in last], grace_s)

    @staticmethod
    def _stop_group(procs: list[ServiceProcess], grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.signal(signal.SIGTERM)
        for p in procs:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.signal(signal.SIGKILL)
                p.proc.wait()
