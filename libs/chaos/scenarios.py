"""The fault scenarios on a running Mesh, shared by the chaos e2e tests and bench/chaos.py.

`run_fault` streams every prompt, strikes once the traffic reaches a point (`after` = so many requests
with so many chunks each), waits for the leak check on the workers still alive, and returns the table
row. `restart_service` brings a killed service back and waits until it serves. `FAULTS` are the five
standard strikes: SIGKILL a decode worker, a prefill worker, a scheduler replica; restart the kv-broker
(kill + start: its state comes back from JetStream) and the nats-server (same port and store).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from libs.bus.ports import read_ports
from libs.chaos.fault_table import FaultResult, summarize
from libs.chaos.load import Progress, stream_many
from libs.chaos.workers import metric_total, request_pages, wait_for_no_leaks
from libs.launch.mesh import Mesh, MeshConfig
from libs.launch.natsauth import NatsAuth
from proto import messages as m

MIGRATIONS = "moemesh_gateway_migrations_total"


def workers(mesh: Mesh, without: str = "") -> list[tuple[m.Role, str]]:
    return [(r, w) for r in (m.Role.PREFILL, m.Role.DECODE) for w in mesh.worker_ids(r) if w != without]


@dataclass(frozen=True)
class Fault:
    """What to strike (`killed` names it in the table), how, when, and whether to restart it after."""

    killed: str
    strike: Callable[[Mesh], None]
    after: tuple[int, int]  # (requests, chunks each) streamed before the strike
    restart: bool = True


def _kill(name: str) -> Callable[[Mesh], None]:
    return lambda mesh: mesh.sup.kill(name)


def _kill_and_start(name: str) -> Callable[[Mesh], None]:
    def strike(mesh: Mesh) -> None:
        mesh.sup.kill(name)
        mesh.sup.start(mesh.sup.procs[name].spec)

    return strike


def standard_faults(n_requests: int) -> list[Fault]:
    return [
        Fault("decode-0", _kill("decode-0"), (n_requests // 2, 3)),
        Fault("prefill-1", _kill("prefill-1"), (4, 1)),
        Fault("scheduler-0", _kill("scheduler-0"), (8, 2)),
        Fault("kv-broker", _kill_and_start("kv-broker"), (n_requests // 4, 2), restart=False),
        Fault("nats-server", lambda mesh: mesh.restart_nats(), (n_requests // 2, 3), restart=False),
    ]


def run_fault(
    mesh: Mesh, fault: Fault, prompts: Sequence[list[int]], want: Sequence[str], max_tokens: int, *,
    deadline_s: float, leak_timeout_s: float,
) -> tuple[FaultResult, dict[str, int]]:  # fmt: skip
    """One scenario; returns the row and what each live worker still holds (request pages + live)."""
    metrics = mesh.url + "/metrics"
    before = metric_total(metrics, MIGRATIONS)

    async def strike(progress: Progress) -> None:
        if not await progress.wait(*fault.after, timeout=deadline_s):
            raise RuntimeError(f"traffic never reached {fault.after} before striking {fault.killed}")
        await asyncio.to_thread(fault.strike, mesh)

    outcomes = asyncio.run(
        stream_many(mesh.url, mesh.model_name, list(prompts), max_tokens, deadline_s=deadline_s, fault=strike)
    )
    live = workers(mesh, without=fault.killed if fault.restart else "")
    left = asyncio.run(wait_for_no_leaks(mesh.nats_url, live, leak_timeout_s, mesh.connect_options()))
    migrated = int(metric_total(metrics, MIGRATIONS) - before)
    leaked = sum(v for v in left.values() if v > 0)
    return summarize(fault.killed, outcomes, want, max_tokens, migrated, leaked), left


def restart_service(mesh: Mesh, name: str, timeout: float = 60.0) -> None:
    """Start a killed service again and wait until it serves (a worker answers admin stats, anything
    else answers /health)."""
    mesh.sup.start(mesh.sup.procs[name].spec)
    worker = name in mesh.worker_ids(m.Role.PREFILL) + mesh.worker_ids(m.Role.DECODE)

    async def back() -> None:
        async with asyncio.timeout(timeout):
            while True:
                if worker:
                    if name in await request_pages(mesh.nats_url, workers(mesh), mesh.connect_options()):
                        return
                elif _healthy(mesh, name):
                    return
                mesh.sup.check_alive()
                await asyncio.sleep(0.2)  # waiting for another process to come up

    asyncio.run(back())


def _healthy(mesh: Mesh, name: str) -> bool:
    ports = read_ports(mesh.ports_file(name))  # None until the restarted process has bound its port
    if ports is None:
        return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def chaos_prompts(n: int) -> list[list[int]]:
    """n token-id prompts of 6..45 tokens: short ones are prefilled on the decode worker, long ones go
    through a prefill worker and Mooncake (with a direct-prefill threshold of 16)."""
    return [[(17 * i + 5 * k) % 900 + 3 for k in range(6 + (i * 7) % 40)] for i in range(n)]


def chaos_config(
    model_dir: Path, log_dir: Path | None, *, password: str, lease_ms: int = 4000, deadline_s: float = 60.0,
    extra_env: dict[str, dict[str, str]] | None = None,
) -> MeshConfig:  # fmt: skip
    """2 prefill + 2 decode workers, 2 scheduler replicas, nats with a user/password; a slower decode
    step, a small KV pool (~14 requests per decode worker) and short waiting lines at the decode workers,
    so streams run long enough to be cut mid-way and requests wait in the schedulers' queues; short
    leases so lost reservations come back within seconds."""
    env = {
        "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "16",
                               "MOEMESH_SCHEDULER_LEASE_MS": str(lease_ms),
                               "MOEMESH_SCHEDULER_MAX_DECODE_WAITING": "4"},
        "services.decode_worker": {"MOEMESH_DECODE_WORKER_FORWARD_SLEEP_MS": "25",
                                   "MOEMESH_DECODE_WORKER_NUM_PAGES": "48"},
        "services.gateway": {"MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": str(deadline_s),
                             "MOEMESH_GATEWAY_MAX_MIGRATIONS": "3"},
    }  # fmt: skip
    for module, values in (extra_env or {}).items():
        env.setdefault(module, {}).update(values)
    return MeshConfig(
        model_dir=model_dir, port=0, log_dir=log_dir, prefill_workers=2, decode_workers=2, schedulers=2,
        nats_auth=NatsAuth(user="moemesh", password=password), extra_env=env,
    )  # fmt: skip
