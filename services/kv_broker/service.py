"""The kv-broker service: the KV directory of the mesh, over proto.subjects.BROKER (request/reply,
queue group QUEUE_BROKER, so replicas share the load)."""

# - Worker registry: RegisterWorker / LookupWorker (Mooncake session id, KV pool geometry). A worker whose KV
#   format (KvGeometry.dtype: the row dtype, or fp8_e4m3) differs from a live worker of the other role is
#   refused: no page it would exchange means the same bytes on both sides. Live: its heartbeats heard by the
#   prefix directory, or registered through this replica within FRESH_REGISTRATION_MS (a worker that
#   registered but has not beaten yet).
# - KV handles with leases: CreateHandle -> HandleWritten -> HandleConsumed, ReleaseHandle, LookupHandle,
#   ListHandles; the rules are in handles.py (pure). Every answer is a BrokerReply; a refusal is
#   ok=False with the reason, and the current record when there is one.
# - Lease expiry: a sweeper wakes when the next lease comes due, marks overdue handles expired
#   (compare-and-set, so one replica wins) and sends HandleExpired to the owning decode worker's inbox.
# - All state lives in two JetStream KV buckets (store.py); a restarted broker reloads it and resumes
#   sweeping; after a reconnect (the nats-server restarted) the mirrors are read again, and handle records
#   the server revived are expired or forgotten by the sweep. Expired records are re-announced at start
#   (at-least-once: a crash between marking and announcing loses nothing; decode workers treat a repeat as
#   a no-op).
# - Prefix index (prefix.py): which worker caches which KV block, from the workers' KV events, answering
#   PrefixQuery on BROKER_PREFIX; soft state rebuilt from worker snapshots, not kept in JetStream.

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Annotated, ClassVar

import msgspec
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge

from libs.bus import BusError, Service, ServiceSettings, now_ms
from libs.bus.event_wait import cancel_and_wait, wait_event
from libs.telemetry import attributes as span_attrs
from proto import messages as m
from proto import subjects
from services.kv_broker import handles
from services.kv_broker.handles import HandleError
from services.kv_broker.prefix_directory import PrefixDirectory
from services.kv_broker.store import MARKER_AGE_S, PURGE_EVERY_S, Bucket, Conflict

log = logging.getLogger("moemesh.kv_broker")

_CAS_ATTEMPTS = 5
FRESH_REGISTRATION_MS = 30_000


class BrokerSettings(ServiceSettings, frozen=True, kw_only=True):
    """Env prefix MOEMESH_KV_BROKER_ (nats_url also from MOEMESH_NATS_URL); flags --<field>."""

    handles_bucket: Annotated[str, msgspec.Meta(description="JetStream KV bucket of KV handles")] = (
        "moemesh_kv_handles"
    )
    workers_bucket: Annotated[str, msgspec.Meta(description="JetStream KV bucket of worker endpoints")] = (
        "moemesh_kv_workers"
    )
    bucket_replicas: Annotated[
        int, msgspec.Meta(ge=1, le=5, description="replicas of the buckets in a NATS cluster")
    ] = 1
    retention_ms: Annotated[
        int, msgspec.Meta(ge=0, description="milliseconds consumed or expired handle records are kept")
    ] = 60_000
    marker_age_s: Annotated[
        float,
        msgspec.Meta(gt=0, description="seconds a bucket's delete markers are kept before they are purged"),
    ] = MARKER_AGE_S
    purge_every_s: Annotated[
        float, msgspec.Meta(ge=0, description="seconds between purges of old delete markers; 0: never")
    ] = PURGE_EVERY_S
    max_lease_ms: Annotated[int, msgspec.Meta(gt=0, description="longest lease a KV handle may ask for")] = (
        600_000
    )
    max_sweep_interval_s: Annotated[
        float, msgspec.Meta(gt=0, description="bound on how late peers' handles are noticed")
    ] = 1.0
    max_in_flight: Annotated[int, msgspec.Meta(ge=1, description="requests handled at once")] = 256
    snapshot_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="seconds to wait for a prefix-index snapshot")
    ] = 2.0
    dead_after_intervals: Annotated[
        float,
        msgspec.Meta(
            gt=0, description="heartbeat periods of silence before a worker leaves the prefix index"
        ),
    ] = 3.0


def _check_geometry(g: m.KvGeometry) -> None:
    if min(g.num_layers, g.num_pages, g.page_size, g.page_bytes, g.base_addr) <= 0:
        raise HandleError(f"KV geometry needs positive sizes and base address, got {g}")
    if g.layer_stride < g.num_pages * g.page_bytes:
        raise HandleError(f"KV geometry layer_stride {g.layer_stride} < num_pages * page_bytes")


class KvBroker(Service):
    name: ClassVar[str] = "kv-broker"
    settings_class: ClassVar[type[ServiceSettings]] = BrokerSettings
    settings: BrokerSettings

    def __init__(
        self,
        settings: BrokerSettings,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        super().__init__(settings, registry)
        self.clock = clock
        self._wake = asyncio.Event()
        self._next_due_ms: int | None = None
        self._sweeper: asyncio.Task | None = None
        self.handles: Bucket[m.HandleRecord] | None = None
        self.workers: Bucket[m.WorkerRecord] | None = None
        self.prefix: PrefixDirectory | None = None
        self._registered_ms: dict[str, int] = {}  # worker id -> when this replica registered it (clock ms)
        self._expired = Counter(
            "moemesh_kv_broker_expired", "Handles expired by lease", registry=self.registry
        )
        self._by_state = Gauge(
            "moemesh_kv_broker_handles", "Handles by state", ["state"], registry=self.registry
        )
        for st in m.HandleState:
            self._by_state.labels(st.name.lower()).set_function(functools.partial(self._count, st))

    def _count(self, state: m.HandleState) -> int:
        return 0 if self.handles is None else sum(1 for _, r in self.handles.items() if r.state == state)

    def _buckets(self) -> tuple[Bucket[m.HandleRecord], Bucket[m.WorkerRecord]]:
        if self.handles is None or self.workers is None:
            raise RuntimeError("kv-broker buckets are not open")
        return self.handles, self.workers

    # --- lifecycle ---
    async def setup(self) -> None:
        s, js = self.settings, self.bus.jetstream()
        markers = {"marker_age_s": s.marker_age_s, "purge_every_s": s.purge_every_s}
        self.workers = Bucket(js, s.workers_bucket, m.WorkerRecord, s.bucket_replicas, **markers)
        self.handles = Bucket(js, s.handles_bucket, m.HandleRecord, s.bucket_replicas, **markers)
        await self.workers.open()
        await self.handles.open()
        log.info("kv-broker loaded %d workers and %d handles", len(self.workers), len(self.handles))
        for _, rec in self.handles.items():
            if rec.state == m.HandleState.EXPIRED:
                await self._announce(rec)
        await self.bus.subscribe(
            subjects.BROKER, m.BrokerRequest, self._traced, queue=subjects.QUEUE_BROKER, concurrent=True,
            max_in_flight=s.max_in_flight,
        )  # fmt: skip
        self._sweeper = self.essential(asyncio.create_task(self._sweep_loop()), "the handle sweeper")
        self.prefix = PrefixDirectory(
            self.bus, self.registry, snapshot_timeout_s=s.snapshot_timeout_s,
            dead_after_intervals=s.dead_after_intervals,
        )  # fmt: skip
        await self.prefix.start()

    async def on_drain(self) -> None:
        if self.prefix is not None:
            await self.prefix.stop()
        if self._sweeper is not None:  # a sweep's JetStream write can lose the cancel (libs.bus.event_wait)
            await cancel_and_wait(self._sweeper)
        for bucket in (self.handles, self.workers):
            if bucket is not None:
                await bucket.close()

    # --- requests ---
    async def _traced(self, req: m.BrokerRequest) -> m.BrokerReply:
        """handle() in a span, for requests made inside a traced request (CreateHandle: the reservation)."""
        name, attrs = f"kv_broker.{type(req).__name__}", span_attrs.broker_request(req)
        with self.telemetry.span(name, kind=SpanKind.SERVER, attributes=attrs, root=False) as span:
            reply = await self.handle(req)
            span.set_attribute("moemesh.ok", reply.ok)
            return reply

    async def handle(self, req: m.BrokerRequest) -> m.BrokerReply:
        try:
            match req:
                case m.RegisterWorker():
                    return await self._register(req)
                case m.LookupWorker(worker_id=wid):
                    found = await self._worker(wid)
                    if found is None:
                        return m.BrokerReply(ok=False, message=f"unknown worker {wid!r}")
                    return m.BrokerReply(ok=True, worker=found[0])
                case m.CreateHandle(handle=h):
                    return await self._create(h)
                case m.HandleWritten(handle_id=hid):
                    return await self._transition(hid, handles.written)
                case m.HandleConsumed(handle_id=hid):
                    return await self._transition(hid, handles.consumed)
                case m.ReleaseHandle(handle_id=hid, reason=reason):
                    return await self._release(hid, reason)
                case m.LookupHandle(handle_id=hid):
                    cur = await self._read(hid)
                    if cur is None:
                        return m.BrokerReply(ok=False, message=f"unknown handle {hid!r}")
                    return m.BrokerReply(ok=True, handle=cur[0])
                case m.ListHandles(decode_worker=wid):
                    recs = [
                        r for _, r in self._buckets()[0].items() if not wid or r.handle.decode_worker == wid
                    ]
                    recs.sort(key=lambda r: r.handle.lease_expires_ms)
                    return m.BrokerReply(ok=True, handles=recs)
        except HandleError as e:
            return m.BrokerReply(ok=False, message=str(e))
        raise HandleError(f"unhandled broker request {type(req).__name__}")  # a new union member

    async def _register(self, req: m.RegisterWorker) -> m.BrokerReply:
        handles.check_id("worker_id", req.worker_id)
        _check_geometry(req.geometry)
        for pool in req.ranks:
            _check_geometry(pool.geometry)
        clash = self._format_clash(req)
        if clash is not None:
            log.error("refused registration of %s: %s", req.worker_id, clash)
            raise HandleError(clash)
        self._registered_ms[req.worker_id] = self.clock()
        rec = m.WorkerRecord(
            worker_id=req.worker_id, role=req.role, session_id=req.session_id, geometry=req.geometry,
            ranks=req.ranks,
        )  # fmt: skip
        await self._buckets()[1].put(req.worker_id, rec)
        log.info("registered %s worker %s at %s", req.role.name.lower(), req.worker_id, req.session_id)
        stale = [hid for hid, h in self._buckets()[0].items() if handles.of_old_incarnation(h, rec)]
        for hid in stale:  # a restarted worker: its old reservations name pages of a process that is gone
            await self._expire(hid, old=rec)
        if stale:
            log.warning(
                "%s is a new incarnation: expired %d handles of its old one", req.worker_id, len(stale)
            )
        return m.BrokerReply(ok=True, worker=rec)

    def _format_clash(self, req: m.RegisterWorker) -> str | None:
        """Why `req`'s KV pages cannot be exchanged with a live worker of the other role, or None."""
        now = self.clock()
        for wid, rec in self._buckets()[1].items():
            if rec.role == req.role or wid == req.worker_id or rec.geometry.dtype == req.geometry.dtype:
                continue
            fresh = now - self._registered_ms.get(wid, -FRESH_REGISTRATION_MS) < FRESH_REGISTRATION_MS
            if fresh or (self.prefix is not None and self.prefix.is_live(wid)):
                mine, theirs = req.role.name.lower(), rec.role.name.lower()
                return (
                    f"KV cache format mismatch: {mine} worker {req.worker_id} holds {req.geometry.dtype} pages, "
                    f"live {theirs} worker {wid} holds {rec.geometry.dtype}; start prefill and decode workers "
                    "with the same kv_cache_dtype (and dtype)"
                )
        return None

    async def _worker(self, wid: str) -> tuple[m.WorkerRecord, int] | None:
        """From the mirror; from the server when another replica registered it a moment ago."""
        workers = self._buckets()[1]
        return workers.get(wid) or (await workers.fetch(handles.check_id("worker_id", wid)))

    async def _read(self, hid: str, fresh: bool = False) -> tuple[m.HandleRecord, int] | None:
        bucket = self._buckets()[0]
        return (None if fresh else bucket.get(hid)) or await bucket.fetch(hid)

    async def _create(self, h: m.KvHandle) -> m.BrokerReply:
        """Write a new handle at once, create-only: one that exists on the server already (a retry, a twin, or
        another replica's write this mirror has not seen) comes back as a Conflict and is answered as a retry."""
        # No read before the write: a JetStream round trip for every handle, almost always a miss.
        bucket = self._buckets()[0]
        worker = await self._worker(h.decode_worker)
        existing = bucket.get(handles.check_id("handle_id", h.handle_id))
        if existing is None:
            try:
                rec = handles.create(None, h, worker and worker[0], self.clock(), self.settings.max_lease_ms)
            except HandleError:  # refused as new; as a retry of one the server holds it may be answered
                existing = await bucket.fetch(h.handle_id)
                if existing is None:
                    raise
            else:
                try:
                    await bucket.create(h.handle_id, rec)
                except Conflict:  # it exists on the server: answered as the same CreateHandle again
                    existing = await bucket.fetch(h.handle_id)
                    if existing is None:  # deleted since: create it anew
                        return await self._create(h)
                else:
                    if self._next_due_ms is None or h.lease_expires_ms < self._next_due_ms:
                        self._wake.set()
                    return m.BrokerReply(ok=True, handle=rec)
        # The same CreateHandle again returns the record; create() refuses any other.
        rec = handles.create(existing[0], h, worker and worker[0], self.clock(), self.settings.max_lease_ms)
        return m.BrokerReply(ok=True, handle=rec)

    async def _transition(
        self, hid: str, step: Callable[[m.HandleRecord, int], m.HandleRecord]
    ) -> m.BrokerReply:
        bucket = self._buckets()[0]
        for attempt in range(_CAS_ATTEMPTS):
            cur = await self._read(hid, fresh=attempt > 0)
            if cur is None:
                return m.BrokerReply(ok=False, message=f"unknown handle {hid!r}")
            rec, rev = cur
            now = self.clock()
            try:
                new = step(rec, now)
            except HandleError as e:
                if handles.overdue(rec, now):  # refuse now, and tell the owner without waiting for the sweep
                    rec = await self._expire(hid) or rec
                return m.BrokerReply(ok=False, message=str(e), handle=rec)
            if new == rec:
                return m.BrokerReply(ok=True, handle=rec)
            try:
                await bucket.update(hid, new, rev)
                return m.BrokerReply(ok=True, handle=new)
            except Conflict:
                continue
        raise HandleError(f"handle {hid} changed under {_CAS_ATTEMPTS} attempts; try again")

    async def _release(self, hid: str, reason: str) -> m.BrokerReply:
        cur = await self._read(hid)
        if cur is None:
            return m.BrokerReply(ok=True, message=f"unknown handle {hid!r} (already forgotten)")
        await self._buckets()[0].delete(hid)
        log.debug("released handle %s (%s)", hid, reason)
        return m.BrokerReply(ok=True, handle=cur[0])

    # --- lease expiry ---
    async def _expire(self, hid: str, old: m.WorkerRecord | None = None) -> m.HandleRecord | None:
        """Mark an overdue handle (or, given the worker's new record, one of its old incarnation)
        expired, if it still is, and announce it; the record, or None."""
        bucket = self._buckets()[0]
        for attempt in range(_CAS_ATTEMPTS):
            cur = await self._read(hid, fresh=attempt > 0)
            if cur is None:
                return None
            rec, rev = cur
            now = self.clock()
            stale = old is not None and handles.of_old_incarnation(rec, old)
            if not (handles.overdue(rec, now) or stale):
                return rec
            new = handles.expire(rec, now, old_incarnation=stale)
            try:
                await bucket.update(hid, new, rev)
            except Conflict:
                continue
            self._expired.inc()
            log.info(
                "handle %s of request %s on %s expired", hid, rec.handle.request_id, rec.handle.decode_worker
            )
            await self._announce(new)
            return new
        return None

    async def _announce(self, rec: m.HandleRecord) -> None:
        h = rec.handle
        try:
            await self.bus.publish(
                subjects.decode_inbox(h.decode_worker),
                m.HandleExpired(handle_id=h.handle_id, request_id=h.request_id),
            )
        except (BusError, ValueError, OSError) as e:
            log.warning("could not announce expiry of %s to %s: %s", h.handle_id, h.decode_worker, e)

    async def sweep(self) -> handles.SweepPlan:
        """One sweep now: expire overdue handles, forget those past retention (the loop calls this;
        tests with a fake clock call it directly)."""
        bucket = self._buckets()[0]
        plan = handles.plan_sweep(bucket.items(), self.clock(), self.settings.retention_ms)
        for hid in plan.expire:
            await self._expire(hid)
        for hid in plan.forget:
            cur = bucket.get(hid)
            if cur is not None:
                with contextlib.suppress(Conflict):  # changed meanwhile: the next sweep decides again
                    await bucket.delete(hid, cur[1])
        return plan

    def _reconnects(self) -> int:
        return self.bus.reconnects

    async def resync(self) -> None:
        """Both buckets' mirrors made what the server holds (after a reconnect: store.Bucket.resync); revived
        handle records then expire or are forgotten by the sweep like any other."""
        for bucket in self._buckets():
            gained, dropped = await bucket.resync()
            if gained or dropped:
                log.warning(
                    "bucket %s after the reconnect: %d keys the mirror lacked (revived by the server's restart), "
                    "%d it held that the server lost", bucket.name, gained, dropped,
                )  # fmt: skip

    async def _sweep_loop(self) -> None:
        """Sleep until the next lease (or retention) comes due, a new earlier lease arrives, or
        max_sweep_interval_s passes (handles another replica created reach us through the mirror)."""
        cap = self.settings.max_sweep_interval_s
        reconnects = self._reconnects()
        while True:
            self._wake.clear()
            try:
                if self._reconnects() != reconnects and self.bus.is_connected:
                    await self.resync()
                    reconnects = self._reconnects()
                plan = await self.sweep()
                self._next_due_ms = plan.next_due_ms
                delay = (
                    cap
                    if plan.next_due_ms is None
                    else min(cap, max(0.0, (plan.next_due_ms - self.clock()) / 1000))
                )
            except Exception:
                log.exception("kv-broker sweep failed; retrying")
                delay = cap
            await wait_event(self._wake, delay)
