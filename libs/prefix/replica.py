"""A prefix index kept current from the bus (index.py holds the rules): the kv-broker's directory and
each scheduler's local replica are one of these."""

# Subscriptions, on the owner's connection:
# - proto.subjects.KV_EVENTS_ALL (no queue group: every replica builds the whole index): BlocksStored /
#   BlocksRemoved, applied in arrival order.
# - proto.subjects.HEARTBEAT_ALL: liveness (a worker silent for dead_after_intervals heartbeats, or one that
#   sent WorkerGone, leaves the index), and discovery: a worker heard but not indexed (a replica that just
#   started, a worker with an empty cache that never sent an event) is asked for a snapshot.
# Snapshots (on a gap or discovery): KvSnapshotRequest to proto.subjects.kv_snapshot(worker), the worker
# being the source of truth, at most one in flight per worker and at most one attempt per
# `resync_backoff_s` for a worker that does not answer. The index is soft state, rebuilt from the workers.
# Metrics are named `<metric_prefix>_blocks`, `_entries`, `_workers`, `_events`, `_resyncs{reason}`,
# `_resync_failures`, `_workers_dropped{reason}`.

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from libs.bus import Bus
from libs.bus.periodic import Periodic
from libs.liveness.stall_clock import StallClock
from libs.prefix.index import PrefixIndex
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.prefix.replica")


class PrefixReplica:
    def __init__(
        self,
        bus: Bus,
        registry: CollectorRegistry,
        metric_prefix: str,
        *,
        snapshot_timeout_s: float = 2.0,
        dead_after_intervals: float = 3.0,
        resync_backoff_s: float = 1.0,
        sweep_interval_s: float = 0.25,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.bus = bus
        # no clock given: silence is measured without this process's own stalls (libs.liveness)
        self.stall_clock = StallClock() if clock is None else None
        self.clock: Callable[[], float] = clock or self.stall_clock or time.monotonic
        self.snapshot_timeout_s, self.resync_backoff_s = snapshot_timeout_s, resync_backoff_s
        self.index = PrefixIndex(dead_after_intervals)
        self._in_flight: dict[str, asyncio.Task] = {}
        self._last_try: dict[str, float] = {}
        self._sweeper = Periodic(sweep_interval_s, self._sweep, "prefix-index-sweep")
        r, p = registry, metric_prefix
        Gauge(f"{p}_blocks", "Distinct KV blocks in the prefix index", registry=r
              ).set_function(lambda: self.index.num_blocks)  # fmt: skip
        Gauge(f"{p}_entries", "(block, worker) pairs in the prefix index", registry=r
              ).set_function(lambda: self.index.num_entries)  # fmt: skip
        Gauge(f"{p}_workers", "Workers in the prefix index", registry=r
              ).set_function(lambda: len(self.index.workers()))  # fmt: skip
        self.m_events = Counter(f"{p}_events", "KV events received", registry=r)
        self.m_resyncs = Counter(
            f"{p}_resyncs", "Snapshots asked of workers, by reason", ["reason"], registry=r
        )
        self.m_resync_failures = Counter(f"{p}_resync_failures", "Snapshot requests unanswered", registry=r)
        self.m_dropped = Counter(
            f"{p}_workers_dropped", "Workers dropped from the index, by reason", ["reason"], registry=r
        )

    async def start(self, heartbeats: bool = True) -> None:
        """heartbeats False: the owner already subscribes to HEARTBEAT_ALL and passes each to on_heartbeat
        (one delivery per heartbeat instead of two: at 56 workers x 4/s they add up)."""
        await self.bus.subscribe(subjects.KV_EVENTS_ALL, m.KvEvent, self.on_event)
        if heartbeats:
            await self.bus.subscribe(subjects.HEARTBEAT_ALL, m.Heartbeat, self.on_heartbeat)
        if self.stall_clock is not None:
            self.stall_clock.start()
        self._sweeper.start()

    async def stop(self) -> None:
        await self._sweeper.stop()
        if self.stall_clock is not None:
            await self.stall_clock.stop()
        tasks = list(self._in_flight.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # --- handlers ---
    async def on_event(self, ev: m.KvEvent) -> None:
        self.m_events.inc()
        if self.index.apply(ev, self.clock()):
            self.resync(ev.worker_id, "gap")

    async def on_heartbeat(self, hb: m.Heartbeat) -> None:
        match hb:
            case m.WorkerHeartbeat(worker_id=wid):
                self.index.heard(wid, self.clock(), hb.interval_ms / 1000)
                if self.index.needs_snapshot(wid):
                    self.resync(wid, "unknown" if self.index.seq_of(wid) is None else "gap")
            case m.WorkerGone(worker_id=wid):
                indexed = self.index.seq_of(wid) is not None
                self.index.drop_worker(wid)  # also forgets the interval of a worker heard but never indexed
                self._last_try.pop(wid, None)
                if indexed:
                    self.m_dropped.labels("gone").inc()
                    log.info("worker %s left: dropped from the prefix index", wid)

    # --- resync ---
    def resync(self, worker_id: str, reason: str) -> None:
        """Ask `worker_id` for a snapshot unless one is in flight or it failed to answer just now."""
        now = self.clock()
        if worker_id in self._in_flight or now - self._last_try.get(worker_id, -1e9) < self.resync_backoff_s:
            return
        self._last_try[worker_id] = now
        self.m_resyncs.labels(reason).inc()
        task = asyncio.create_task(self._snapshot(worker_id))
        self._in_flight[worker_id] = task
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        for wid, t in list(self._in_flight.items()):
            if t is task:
                del self._in_flight[wid]

    async def _snapshot(self, worker_id: str) -> None:
        try:
            snap: m.KvSnapshot = await self.bus.request(
                subjects.kv_snapshot(subjects.check_token(worker_id)),
                m.KvSnapshotRequest(worker_id=worker_id),
                m.KvSnapshot,
                timeout=self.snapshot_timeout_s,
            )
        except Exception as e:  # retried on its next event or heartbeat, after the backoff
            self.m_resync_failures.inc()
            log.info("no KV snapshot from %s: %s", worker_id, e)
            return
        again = self.index.load_snapshot(snap, self.clock())
        self._last_try.pop(worker_id, None)
        log.info("prefix index: %s resynced at seq %d (%d blocks)", worker_id, snap.seq, len(snap.hashes))
        if again:
            self._in_flight.pop(worker_id, None)
            self.resync(worker_id, "gap")

    async def _sweep(self) -> None:
        for wid in self.index.expire(self.clock()):
            self._last_try.pop(wid, None)
            self.m_dropped.labels("silent").inc()
            log.warning("worker %s missed its heartbeats: dropped from the prefix index", wid)
