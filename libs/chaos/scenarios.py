"""The fault scenarios on a running, supervised Mesh, shared by the chaos e2e tests and bench/chaos.py."""

# Every fault is a SIGKILL, as a crash would be: of a decode worker, a prefill worker, a scheduler replica,
# the kv-broker or the nats-server. Nothing here starts the killed service again: the launcher's
# supervisor (libs.launch.supervisor, the same one `moemesh up` runs) does, and `run_fault` measures it.
# `run_fault` streams every prompt (greedy, ignore_eos, long enough that none has finished when the fault
# strikes), strikes once the traffic reaches a point (`after` = so many requests with so many chunks each),
# waits until the supervisor has the killed service back and serving, waits for the leak check on every
# worker, and returns the table row.

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.msg import Msg

from libs.bus.ports import read_ports
from libs.chaos.fault_table import FaultResult, summarize
from libs.chaos.load import Progress, stream_many
from libs.chaos.workers import metric_total, request_pages, wait_for_no_leaks
from libs.launch.mesh import NATS, Mesh, MeshConfig
from libs.launch.natsauth import NatsAuth
from proto import decoder, subjects
from proto import messages as m

MIGRATIONS = "moemesh_gateway_migrations_total"


def workers(mesh: Mesh) -> list[tuple[m.Role, str]]:
    return [(r, w) for r in (m.Role.PREFILL, m.Role.DECODE) for w in mesh.worker_ids(r)]


@dataclass(frozen=True)
class Fault:
    """Which service to SIGKILL, and when: after `after` = (requests, chunks each) streamed. With `queued`
    (a scheduler replica), the replica killed is the first of the mesh's replicas whose heartbeat then
    reports requests waiting in its queue (`killed` names the fault; the row names the replica)."""

    killed: str
    after: tuple[int, int]
    queued: bool = False


def standard_faults(n_requests: int) -> list[Fault]:
    """Each strikes early, when 6 streams have a few chunks and none has finished (48-token streams)."""
    first = min(6, n_requests)
    return [
        Fault("decode-0", (first, 3)),
        Fault("prefill-1", (4, 1)),
        Fault("scheduler-0", (first, 2), queued=True),
        Fault("kv-broker", (first, 2)),
        Fault(NATS, (first, 3)),
    ]


@dataclass
class _Strike:
    finished_before: int = -1  # streams already finished when the fault struck
    back_s: float = -1.0  # strike to the killed service serving again
    killed: str = ""  # the service struck (for `queued`, the replica that had a queue)
    restarts_before: int = 0


def run_fault(
    mesh: Mesh, fault: Fault, prompts: Sequence[list[int]], want: Sequence[list[int]] | None, max_tokens: int, *,
    deadline_s: float, leak_timeout_s: float, back_timeout_s: float = 90.0,
) -> tuple[FaultResult, dict[str, int]]:  # fmt: skip
    """One scenario; returns the row and what each worker still holds (request pages + live)."""

    def migrations() -> float:  # every gateway replica's own count
        return sum(metric_total(url, MIGRATIONS) for url in mesh.gateway_metrics_urls())

    before = migrations()
    seen = _Strike(killed=fault.killed)

    async def strike(progress: Progress) -> None:
        queues = QueueWatch(mesh, mesh.scheduler_names()) if fault.queued else None
        if queues is not None:
            await queues.start()  # watching from the first request on: no heartbeat before the point is lost
        try:
            if not await progress.wait(*fault.after, timeout=deadline_s):
                raise RuntimeError(f"traffic never reached {fault.after} before striking {fault.killed}")
            if queues is not None:
                seen.killed = await queues.first_queued(progress, timeout=deadline_s)
        finally:
            if queues is not None:
                await queues.close()
        seen.finished_before = progress.finished()
        seen.restarts_before = mesh.sup.restarts(seen.killed)
        t0 = time.monotonic()
        await asyncio.to_thread(mesh.sup.kill, seen.killed)
        await asyncio.to_thread(wait_serving, mesh, seen.killed, seen.restarts_before + 1, back_timeout_s)
        seen.back_s = time.monotonic() - t0

    outcomes = asyncio.run(
        stream_many(mesh.url, mesh.model_name, list(prompts), max_tokens, deadline_s=deadline_s, fault=strike)
    )
    left = asyncio.run(
        wait_for_no_leaks(mesh.nats_url, workers(mesh), leak_timeout_s, mesh.connect_options())
    )
    migrated = int(migrations() - before)
    leaked = sum(v for v in left.values() if v > 0)
    row = summarize(seen.killed, outcomes, want, max_tokens, migrated, leaked)
    row.finished_before_strike = seen.finished_before
    row.restarts = mesh.sup.restarts(seen.killed) - seen.restarts_before
    row.back_s = round(seen.back_s, 2)
    return row, left


class QueueWatch:
    """The scheduler replicas' heartbeats: what each last reported waiting in its queue."""

    def __init__(self, mesh: Mesh, schedulers: Sequence[str]) -> None:
        self.mesh, self.schedulers = mesh, list(schedulers)
        self.latest: dict[str, int] = {}  # replica -> `queued` of its last heartbeat
        self.most: dict[str, int] = {}  # replica -> the most it ever reported
        self.beats = 0
        self._changed = asyncio.Event()
        self._nc: nats.NATS | None = None

    async def start(self) -> None:
        dec = decoder(m.SchedulerHeartbeat)

        async def on_beat(msg: Msg) -> None:
            hb = dec.decode(msg.data)
            if hb.scheduler_id in self.schedulers:
                self.beats += 1
                self.latest[hb.scheduler_id] = hb.queued
                self.most[hb.scheduler_id] = max(hb.queued, self.most.get(hb.scheduler_id, 0))
                self._changed.set()

        self._nc = await nats.connect(self.mesh.nats_url, **self.mesh.connect_options())
        await self._nc.subscribe(subjects.SCHED_HEARTBEAT, cb=on_beat)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    def queued(self) -> str | None:
        """The first replica (in the mesh's order) whose last heartbeat reported a request in its queue."""
        return next((s for s in self.schedulers if self.latest.get(s, 0) > 0), None)

    async def first_queued(self, progress: Progress, timeout: float) -> str:
        """The replica `queued` names, as soon as there is one; an error saying what was seen if none is
        within `timeout`, or once every stream has ended (no request is left to queue)."""
        deadline = time.monotonic() + timeout
        while (name := self.queued()) is None:
            left = deadline - time.monotonic()
            if left <= 0 or progress.finished() == len(progress.chunks):
                raise RuntimeError(
                    f"no scheduler of {self.schedulers} reported a queued request: {self.beats} heartbeats, "
                    f"most queued {self.most}, last {self.latest}; {progress.finished()} of "
                    f"{len(progress.chunks)} streams ended, chunks {progress.chunks}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait(), min(left, 1.0)
                )  # re-check the streams each second
        return name


def wait_serving(mesh: Mesh, name: str, restarts: int, timeout: float = 90.0) -> None:
    """Until the supervisor has restarted `name` (`restarts` in all) and it serves again: a worker
    answers admin stats, the nats-server accepts connections, anything else answers /health."""
    deadline = time.monotonic() + timeout
    mesh.wait_restarted(name, restarts, timeout)
    worker = name in mesh.worker_ids(m.Role.PREFILL) + mesh.worker_ids(m.Role.DECODE)

    async def serving() -> bool:
        if worker:
            return name in await request_pages(mesh.nats_url, workers(mesh), mesh.connect_options())
        return name == NATS or _healthy(mesh, name)

    while not asyncio.run(serving()):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{name} restarted but not serving after {timeout:.0f}s; logs in {mesh.log_dir}"
            )
        time.sleep(0.2)  # waiting for another process to come up


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
    """2 prefill + 2 decode workers, 2 scheduler replicas, nats with a user/password, a slower decode step
    (streams live long enough to be cut mid-way), decode batches of 4 with a waiting line of 1, short leases
    (lost reservations come back within seconds)."""
    # A replica places at most 5 requests on a decode worker until its next heartbeat, so of 24 streams
    # submitted at once at least 4 wait in the replicas' queues: a scheduler kill strikes the one holding them.
    env = {
        "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "16",
                               "MOEMESH_SCHEDULER_LEASE_MS": str(lease_ms),
                               "MOEMESH_SCHEDULER_MAX_DECODE_WAITING": "1"},
        "services.decode_worker": {"MOEMESH_DECODE_WORKER_FORWARD_SLEEP_MS": "25",
                                   "MOEMESH_DECODE_WORKER_NUM_PAGES": "64",
                                   "MOEMESH_DECODE_WORKER_MAX_NUM_SEQS": "4"},
        "services.gateway": {"MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": str(deadline_s),
                             "MOEMESH_GATEWAY_MAX_MIGRATIONS": "3"},
    }  # fmt: skip
    for module, values in (extra_env or {}).items():
        env.setdefault(module, {}).update(values)
    return MeshConfig(
        model_dir=model_dir, port=0, log_dir=log_dir, prefill_workers=2, decode_workers=2, schedulers=2,
        nats_auth=NatsAuth(user="moemesh", password=password), extra_env=env,
    )  # fmt: skip
