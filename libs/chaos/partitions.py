"""Network partitions on a running mesh whose every service is a host of its own (libs.chaos.netns): under
steady streaming traffic, cut two hosts apart for a while, heal, and measure what the clients saw, how
soon the mesh served at its earlier rate again, and what the workers and the kv-broker still hold after."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nats

from libs.chaos.netns import Network
from libs.chaos.traffic import Traffic
from libs.chaos.workers import wait_for_no_leaks
from libs.launch.mesh import NATS, Host, Mesh, MeshConfig
from libs.launch.natsauth import NatsAuth
from proto import decoder, encode, subjects
from proto import messages as m

HOSTS = (NATS, "kv-broker", "scheduler", "prefill-0", "prefill-1", "decode-0", "decode-1", "gateway")
RECOVERED = 0.8  # "full rate again": the trailing window's rate is at least this share of the rate before


@dataclass(frozen=True)
class Partition:
    name: str
    a: str  # the two hosts cut apart (every packet between them dropped, both ways)
    b: str
    what: str


STANDARD = (
    Partition("decode-nats", "decode-0", NATS, "a decode worker cut from NATS"),
    Partition("prefill-decode", "prefill-0", "decode-0", "a prefill worker cut from the decode worker's Mooncake ports, the bus intact"),
    Partition("gateway-nats", "gateway", NATS, "the gateway cut from NATS (its clients still reach it)"),
    Partition("broker-nats", "kv-broker", NATS, "the kv-broker cut from NATS"),
)  # fmt: skip


def partition_config(
    model_dir: Path, log_dir: Path | None, net: Network, *, password: str, lease_ms: int, deadline_s: float,
    workers: int = 2, num_pages: int = 128, extra_env: dict[str, dict[str, str]] | None = None,
) -> MeshConfig:  # fmt: skip
    """`workers` prefill + `workers` decode workers, a scheduler, the kv-broker, the gateway and nats
    (user/password). The hosts of `net` run in their namespaces; the rest, the nats-server included unless
    `net` has it, on the bridge's own address. No prefix cache (a repeated prompt still crosses Mooncake)."""
    env = {
        "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "16",
                               "MOEMESH_SCHEDULER_LEASE_MS": str(lease_ms)},
        "services.decode_worker": {"MOEMESH_DECODE_WORKER_NUM_PAGES": str(num_pages),
                                   "MOEMESH_DECODE_WORKER_ENABLE_PREFIX_CACHE": "false"},
        "services.prefill_worker": {"MOEMESH_PREFILL_WORKER_ENABLE_PREFIX_CACHE": "false"},
        "services.gateway": {"MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": str(deadline_s),
                             "MOEMESH_GATEWAY_MAX_MIGRATIONS": "3"},
    }  # fmt: skip
    for module, values in (extra_env or {}).items():
        env.setdefault(module, {}).update(values)
    placement = {NATS: Host(net.gateway_address), **net.hosts}
    return MeshConfig(
        model_dir=model_dir, host=net.gateway_address, port=0, log_dir=log_dir, prefill_workers=workers,
        decode_workers=workers, schedulers=1, nats_auth=NatsAuth(user="moemesh", password=password),
        extra_env=env, placement=placement,
    )  # fmt: skip


@dataclass
class PartitionResult:
    partition: str
    what: str
    cut_s: float
    requests: int  # ended between the start of the cut and the end of the run
    counts: dict[str, int]  # of those, by Traffic status (ok, wrong, retryable, error, hung, cancelled)
    error_samples: list[str]
    baseline_rps: float  # requests finished ok per second before the cut
    during_cut_rps: float
    recovered_s: float | None  # heal -> the trailing window's ok rate >= RECOVERED x baseline (None: never)
    max_request_s: float
    left_on_workers: dict[str, int] = field(default_factory=dict)  # request pages + live requests, after
    live_handles: int = -1  # RESERVED or WRITTEN handles at the kv-broker, after

    def as_dict(self) -> dict:
        return asdict(self)


async def live_handles(mesh: Mesh, timeout: float) -> int:
    """Until the kv-broker lists no RESERVED or WRITTEN handle (or the timeout): how many it lists then."""
    dec = decoder(m.BrokerReply)
    deadline = time.monotonic() + timeout
    nc = await nats.connect(mesh.nats_url, **mesh.connect_options())
    try:
        while True:
            try:
                r = await nc.request(subjects.BROKER, encode(m.ListHandles()), timeout=5)
                reply = dec.decode(r.data)
                live = sum(h.state in (m.HandleState.RESERVED, m.HandleState.WRITTEN) for h in reply.handles)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                live = -1
            if live == 0 or time.monotonic() > deadline:
                return live
            await asyncio.sleep(0.25)  # leases run out in the broker: nothing to wait on but its answers
    finally:
        await nc.close()


async def run_partition(
    mesh: Mesh, net: Network, part: Partition, traffic: Traffic, *, clients: int, window_s: float,
    cut_s: float, recover_timeout_s: float, leak_timeout_s: float,
) -> PartitionResult:  # fmt: skip
    """Traffic from `clients` clients; the rate over `window_s` before the cut is the baseline; the cut
    lasts `cut_s`; after the heal, traffic runs until the rate is back (or `recover_timeout_s`)."""
    stop = asyncio.Event()
    first = len(traffic.records)
    load = asyncio.create_task(traffic.closed_loop(clients, stop))

    def ok_rate(t0: float, t1: float) -> float:
        return sum(r.status == "ok" for r in traffic.ended_between(t0, t1)) / max(t1 - t0, 1e-9)

    try:
        await asyncio.sleep(2 * window_s)  # warm-up, then one window to measure the rate before
        t_cut = time.monotonic()
        baseline = ok_rate(t_cut - window_s, t_cut)
        await asyncio.to_thread(net.cut, part.a, part.b)
        await asyncio.sleep(cut_s)  # the partition's length is the experiment's parameter
        await asyncio.to_thread(net.heal, part.a, part.b)
        t_heal = time.monotonic()
        recovered = None
        while (now := time.monotonic()) - t_heal < recover_timeout_s:
            if now - t_heal >= window_s and ok_rate(now - window_s, now) >= RECOVERED * baseline:
                recovered = now - t_heal
                break
            await asyncio.sleep(0.25)  # the rate is read from records the load appends
    finally:
        net.heal_all()
        stop.set()
        await load
    left = await wait_for_no_leaks(
        mesh.nats_url, [(r, w) for r in (m.Role.PREFILL, m.Role.DECODE) for w in mesh.worker_ids(r)],
        leak_timeout_s, mesh.connect_options(),
    )  # fmt: skip
    handles = await live_handles(mesh, leak_timeout_s)
    after = [r for r in traffic.records[first:] if r.end >= t_cut]
    errors = sorted({r.detail for r in after if r.status in ("retryable", "error", "wrong", "hung")})
    return PartitionResult(
        partition=part.name, what=part.what, cut_s=cut_s, requests=len(after), counts=traffic.counts(after),
        error_samples=[e[:200] for e in errors[:6]], baseline_rps=round(baseline, 2),
        during_cut_rps=round(ok_rate(t_cut, t_heal), 2),
        recovered_s=None if recovered is None else round(recovered, 2),
        max_request_s=round(max((r.end - r.start for r in after), default=0.0), 2),
        left_on_workers=left, live_handles=handles,
    )  # fmt: skip
