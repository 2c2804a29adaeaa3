"""The scheduler service: the NATS shell around the pure policy (policy.py) and queue (queue.py)."""

# Subscriptions: SCHED_SUBMIT in queue group QUEUE_SCHEDULER (replicas share the work; each request is
# answered at once with SubmitReply: admitted, or refused 400 / 429 / 503 / 504), HEARTBEAT (the worker
# view) and CANCEL (drop a queued request). A submit with nothing queued ahead of it is placed by its own
# handler (its DecodeDirect or ReserveKv leaves ahead of the SubmitReply: no pass of the loop on the TTFT
# path). Otherwise one
# placement loop walks the queue in FIFO order whenever something changes (a submit, a heartbeat, a cancel, a
# finished placement: an asyncio.Event) or a deadline / worker expiry comes due, and stops at the first
# request that must wait, so a large request is not starved by small ones behind it.
#
# Placing a request: direct -> publish DecodeDirect to the decode worker; disaggregated -> ReserveKv
# request/reply to the decode worker (bounded by reserve_timeout_s and the request's deadline), then
# PrefillTask with the returned KvHandle to the prefill worker. A refused or unanswered reservation
# suspends that decode worker until its next heartbeat and puts the request back in line (up to
# max_retries); a request that is not placed before its deadline, or runs out of retries, gets a
# RequestError on its stream subject, which ends the gateway's stream.
#
# Embedded (a gateway's `embedded_scheduler`): the same service in the gateway's event loop, still a member
# of the queue group; the host gateway's own submits arrive through `submit_local` instead of the bus.

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import msgspec
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from libs.bus import (
    BusError,
    DeadlineExceeded,
    PayloadTooLarge,
    Service,
    ServiceSettings,
    current_traceparent,
    request_context,
)
from libs.bus.event_wait import cancel_and_wait, wait_event
from libs.liveness import StallClock
from libs.prefix.replica import PrefixReplica
from libs.telemetry import attributes as span_attrs
from libs.telemetry import mark_error
from proto import messages as m
from proto import subjects
from services.scheduler.failover import SchedulerBeacon, place, placed_notice
from services.scheduler.policy import (
    Decision,
    PlacementRequest,
    Plan,
    PlanKind,
    PolicyConfig,
    Refuse,
    WorkerTable,
)
from services.scheduler.prefix_lookup import PrefixClient
from services.scheduler.queue import AdmissionQueue, DuplicateRequest, Entry, QueueFull, Retry

log = logging.getLogger("moemesh.scheduler")


class SchedulerSettings(ServiceSettings, frozen=True, kw_only=True):
    """Env prefix MOEMESH_SCHEDULER_ (nats_url also from MOEMESH_NATS_URL); flags --<field>."""

    direct_prefill_threshold: Annotated[
        int,
        msgspec.Meta(ge=0, description="prompts up to this many tokens skip the prefill worker; 0: never"),
    ] = 256
    max_queue: Annotated[
        int, msgspec.Meta(ge=1, description="requests waiting for a placement before submits get 429")
    ] = 1024
    queue_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="longest wait for a placement, in seconds")
    ] = 60.0
    reserve_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="seconds to wait for a decode worker's KV reservation")
    ] = 2.0
    lease_ms: Annotated[
        int, msgspec.Meta(ge=1, description="lease of a reserved KV handle, in milliseconds")
    ] = 30_000
    max_retries: Annotated[
        int, msgspec.Meta(ge=0, description="placements retried after a failed reservation")
    ] = 2
    dead_after_intervals: Annotated[
        float, msgspec.Meta(gt=0, description="heartbeat periods of silence before a worker counts as gone")
    ] = 3.0
    heartbeat_interval_ms: Annotated[
        int, msgspec.Meta(ge=10, description="milliseconds between scheduler heartbeats to the gateways")
    ] = 250
    max_decode_waiting: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="placed but not yet running requests per decode worker before it counts as full; 0: no bound",
        ),
    ] = 32
    prefix_weight: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description="a full prefix-cache hit is worth this many queued requests; 0: load-only placement",
        ),
    ] = 8.0
    prefix_query_timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0, description="seconds the prefix index has to answer, else placement ignores it"),
    ] = 0.05
    prefix_host_weight: Annotated[
        float,
        msgspec.Meta(
            gt=0, le=1,
            description="a prefix block on a worker's host KV tier counts this much of one on its device",
        ),
    ] = 0.8
    prefix_store_weight: Annotated[
        float,
        msgspec.Meta(
            gt=0, le=1, description="a prefix block in the shared KV store counts this much of one on a device"
        ),
    ] = 0.5
    prefix_pending_ttl_s: Annotated[
        float,
        msgspec.Meta(ge=0, description="seconds this scheduler's own recent placements count as prefix hits"),
    ] = 5.0
    decode_prefix_reuse: Annotated[
        bool, msgspec.Meta(description="decode workers skip receiving a prefix they cache already")
    ] = True
    prefix_index: Annotated[
        str,
        msgspec.Meta(
            description="where prefix hits come from: local (this replica's index) or broker (a query per placement)"
        ),
    ] = "local"
    overlap_prefill: Annotated[
        bool,
        msgspec.Meta(
            description="start the prefill while the decode worker reserves pages (PrefillStart with the ReserveKv)"
        ),
    ] = True

    def __post_init__(self) -> None:
        if self.prefix_index not in ("local", "broker"):
            raise ValueError(f"prefix_index must be local or broker, got {self.prefix_index!r}")
        if not 0 < self.prefix_store_weight <= self.prefix_host_weight <= 1:
            raise ValueError(
                "prefix tier weights must keep device >= host >= store > 0: 0 < prefix_store_weight "
                f"({self.prefix_store_weight}) <= prefix_host_weight ({self.prefix_host_weight}) <= 1"
            )


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = Gauge(
            "moemesh_scheduler_queue_depth", "Requests waiting for a placement", registry=registry
        )
        self.placing = Gauge(
            "moemesh_scheduler_placing", "Placements in flight (reservations)", registry=registry
        )
        self.placements = Counter(
            "moemesh_scheduler_placements", "Requests placed, by kind", ["kind"], registry=registry
        )
        self.refusals = Counter(
            "moemesh_scheduler_refusals", "Requests refused or failed, by code", ["code"], registry=registry
        )
        self.retries = Counter(
            "moemesh_scheduler_retries", "Placements retried after a failed reservation", registry=registry
        )
        self.placement_seconds = Histogram(
            "moemesh_scheduler_placement_seconds",
            "Admission to placement (task sent to the workers)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.live_workers = Gauge(
            "moemesh_scheduler_live_workers", "Workers heard recently, by role", ["role"], registry=registry
        )
        # received == placements + refusals + cancelled + queue_depth + placing, at any time
        self.received = Counter(
            "moemesh_scheduler_requests_received", "Submits handled (admitted or refused)", registry=registry
        )
        self.cancelled = Counter(
            "moemesh_scheduler_cancelled", "Admitted requests cancelled before placement", registry=registry
        )


class _ReservationRefused(Exception):
    pass


def _placement_request(s: m.Submit) -> PlacementRequest:
    """Validate a submit (ValueError names the problem)."""
    if not s.request_id:
        raise ValueError("empty request_id")
    if not s.stream_subject or any(c in s.stream_subject for c in " \t\r\n*>"):
        raise ValueError(f"invalid stream_subject {s.stream_subject!r}")
    return PlacementRequest(s.request_id, s.model, len(s.prompt_ids), s.sampling.max_tokens)


class SchedulerService(Service):
    """Admission, queueing and placement of requests on workers (see the module docstring)."""

    name: ClassVar[str] = "scheduler"
    settings_class: ClassVar[type[ServiceSettings]] = SchedulerSettings
    settings: SchedulerSettings

    def __init__(
        self,
        settings: SchedulerSettings,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(settings, registry)
        self.clock = clock
        # Worker silence is measured without this process's own stalls (a saturated scheduler reads
        # heartbeats late); a clock given by a test is used as it is.
        self.stall_clock = StallClock() if clock is time.monotonic else None
        self.heard_clock: Callable[[], float] = self.stall_clock or clock
        self.config = PolicyConfig(
            direct_prefill_threshold=settings.direct_prefill_threshold,
            dead_after_intervals=settings.dead_after_intervals,
            prefix_weight=settings.prefix_weight,
        )
        self.prefix: PrefixClient | None = None  # set once the bus is up
        self.replica: PrefixReplica | None = None  # the local prefix index (prefix_index=local)
        self.workers = WorkerTable(settings.dead_after_intervals)
        self.queue = AdmissionQueue(settings.max_queue, settings.max_retries)
        self.metrics = _Metrics(self.registry)
        self._wake = asyncio.Event()
        self._tick = asyncio.Event()  # replaced on every wake(): lets observers wait for the next change
        self._loop_task: asyncio.Task | None = None
        self._placements: set[asyncio.Task] = set()
        # one submit at a time, as the bus delivers one subscription's messages: in-process submits (an
        # embedding gateway's) and bus submits would otherwise interleave at the handler's awaits
        self._submits = asyncio.Lock()

    # --- lifecycle ---
    async def setup(self) -> None:
        bus = self.bus
        await bus.subscribe(subjects.SCHED_SUBMIT, m.Submit, self._submit_one, queue=subjects.QUEUE_SCHEDULER)
        await bus.subscribe(subjects.HEARTBEAT_ALL, m.Heartbeat, self._on_heartbeat)
        if self.stall_clock is not None:
            self.stall_clock.start()
        await bus.subscribe(subjects.CANCEL, m.Cancel, self._on_cancel)
        s = self.settings
        if s.prefix_weight > 0 and s.prefix_index == "local":
            self.replica = PrefixReplica(
                bus,
                self.registry,
                "moemesh_scheduler_prefix_index",
                dead_after_intervals=s.dead_after_intervals,
                clock=self.heard_clock,
            )
            await self.replica.start(heartbeats=False)  # _on_heartbeat hands them over
        await bus.flush()
        self.prefix = PrefixClient(
            bus, self.registry, s.prefix_query_timeout_s, s.prefix_pending_ttl_s, self.clock, self.replica,
            tier_weights=(s.prefix_host_weight, s.prefix_store_weight),
        )  # fmt: skip
        self._loop_task = self.essential(
            asyncio.create_task(self._placement_loop(), name="scheduler-placement"), "the placement loop"
        )
        self.beacon = SchedulerBeacon(
            bus, self.instance_id, self.settings.heartbeat_interval_ms, lambda: len(self.queue)
        )
        self.beacon.start()

    async def on_drain(self) -> None:
        """Stop placing, let placements in flight finish, then fail what is still queued: no other
        replica knows those requests, and the gateway should hear now rather than at its deadline."""
        if self._loop_task is not None:
            with contextlib.suppress(Exception):  # it failed: the drain goes on regardless
                await cancel_and_wait(self._loop_task)  # again while it runs on (a cancel lost in nats-py)
        if self._placements:
            await asyncio.wait(set(self._placements), timeout=self.settings.reserve_timeout_s + 1.0)
        while (e := self.queue.head()) is not None:
            self.queue.remove(e.request_id)
            await self._fail(e, m.ErrorCode.UNAVAILABLE, "scheduler is shutting down")
        self._update_gauges()
        await self.beacon.stop()
        if self.replica is not None:
            await self.replica.stop()
        if self.stall_clock is not None:
            await self.stall_clock.stop()

    def wake(self) -> None:
        """Something changed (submit, heartbeat, cancel, placement done): run a placement pass."""
        self._wake.set()
        self._tick.set()
        self._tick = asyncio.Event()

    async def next_change(self) -> None:
        """Return at the next wake() (tests and admin tools wait on conditions with this)."""
        await self._tick.wait()

    async def prefix_hits(self, submit: m.Submit) -> dict[str, int]:
        """Cached prompt tokens per worker id, for the policy, from the kv-broker's prefix index ({} on
        timeout). prefix_weight 0 turns prefix awareness off: nothing is asked, so the direct-prefill
        decision, too, goes by prompt length alone."""
        if self.prefix is None or self.config.prefix_weight == 0:
            return {}
        return await self.prefix.hits(submit.prompt_ids, self.workers.page_sizes(self.heard_clock()))

    def _note_prefix(self, s: m.Submit, prefill_worker: str) -> None:
        """Until its KV events arrive, this placement counts as the prompt cached on that worker."""
        w = self.workers.get(prefill_worker)
        if self.prefix is not None and w is not None and self.config.prefix_weight > 0:
            self.prefix.placed(s.prompt_ids, prefill_worker, w.hb.page_size)

    # --- handlers ---
    async def submit_local(self, s: m.Submit, timeout: float) -> m.SubmitReply:
        """A Submit from this process (a gateway embedding this scheduler), handled as one that came on
        SCHED_SUBMIT: the same reply, the same errors (libs.bus `request_local`), no bus hop."""
        return await self.bus.request_local(
            subjects.SCHED_SUBMIT, m.Submit, self._submit_one, s, m.SubmitReply, timeout
        )

    async def _submit_one(self, s: m.Submit) -> m.SubmitReply:
        async with self._submits:
            return await self._on_submit(s)

    async def _on_submit(self, s: m.Submit) -> m.SubmitReply:
        self.metrics.received.inc()
        try:
            req = _placement_request(s)
        except ValueError as e:
            return self._refuse(s.request_id, m.ErrorCode.BAD_REQUEST, str(e))
        # Nothing waiting ahead of it: decide with the prefix index now, and place it at once (below)
        # instead of in a later pass of the loop; otherwise it queues behind the others (FIFO).
        first = self.queue.head() is None
        hits = await self.prefix_hits(s) if first else None
        now = self.clock()
        decision = self._decide(now, req, s, hits)
        if isinstance(decision, Refuse) and hits is None:  # a cached prefix can make it servable
            decision = self._decide(now, req, s, await self.prefix_hits(s))
        if isinstance(decision, Refuse):
            return self._refuse(s.request_id, decision.code, decision.message)
        # The submit's deadline header is when the gateway stops waiting for this reply, not the
        # request's deadline, so it is not carried onward; the queue wait has its own bound, and the
        # gateway ends a request earlier with Cancel.
        deadline = now + self.settings.queue_timeout_s
        try:
            entry = self.queue.admit(s, now, deadline, current_traceparent())
        except QueueFull as e:
            return self._refuse(s.request_id, m.ErrorCode.TOO_MANY_REQUESTS, str(e))
        except DuplicateRequest as e:
            return self._refuse(s.request_id, m.ErrorCode.BAD_REQUEST, str(e))
        if first and isinstance(decision, Plan) and self.queue.head() is entry:
            # Placed now, a pass of the placement loop (and a second prefix lookup and decision) earlier
            # than it would otherwise, and its first message leaves ahead of this reply (the reply is off
            # the TTFT path, the placement is on it). A direct placement is publishes only, so it is done
            # here; a reservation waits for its answer in a task, which sends its ReserveKv during the yield.
            if decision.kind is PlanKind.DIRECT:
                self._take(entry, decision)
                await self._place(entry, decision)
            else:
                self._start_placement(entry, decision)
                await asyncio.sleep(0)
        else:
            self.wake()
        self._update_gauges()
        return m.SubmitReply(request_id=s.request_id, ok=True, scheduler_id=self.instance_id)

    def _decide(
        self, now: float, req: PlacementRequest, s: m.Submit, hits: dict[str, int] | None
    ) -> Decision:
        """The policy through failover.place: avoided workers, full decode lines, decode-local fallback."""
        live = self.workers.live(self.heard_clock())
        return place(live, req, self.config, hits, s.avoid, self.settings.max_decode_waiting)

    def _refuse(self, request_id: str, code: int, message: str) -> m.SubmitReply:
        self.metrics.refusals.labels(str(int(code))).inc()
        log.info("refused %s: [%d] %s", request_id, code, message)
        return m.SubmitReply(request_id=request_id, ok=False, code=int(code), message=message)

    async def _on_heartbeat(self, hb: m.WorkerHeartbeat | m.WorkerGone) -> None:
        if self.replica is not None:
            await self.replica.on_heartbeat(hb)
        match hb:
            case m.WorkerHeartbeat():
                try:
                    self.workers.observe(hb, self.heard_clock())
                except ValueError as e:
                    log.warning("ignored heartbeat: %s", e)
                    return
            case m.WorkerGone(worker_id=wid):
                if self.workers.gone(wid):
                    log.info("worker %s left", wid)
        self.wake()

    async def _on_cancel(self, c: m.Cancel) -> None:
        depth = self.queue.depth
        if self.queue.cancel(c.request_id):
            if self.queue.depth < depth:  # it was waiting; one being placed is counted where it stops
                self.metrics.cancelled.inc()
            log.info("cancelled %s while queued (%s)", c.request_id, c.reason)
            self._update_gauges()
            self.wake()

    # --- placement ---
    async def _placement_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._place_ready()
            except Exception:  # a bug here must not stop placement for good
                log.exception("placement pass failed")
            timeout = self._next_timer()
            await wait_event(self._wake, timeout)

    def _next_timer(self) -> float | None:
        now, heard = self.clock(), self.heard_clock()
        expiry = self.workers.next_expiry()
        worker_due = None if expiry is None else expiry - heard + now  # in this clock's time
        times = [t for t in (self.queue.next_deadline(), worker_due) if t is not None]
        return max(0.0, min(times) - now) + 0.001 if times else None

    async def _place_ready(self) -> None:
        """One pass: drop the dead, fail the late, place from the head until a request must wait."""
        now, heard = self.clock(), self.heard_clock()
        for wid in self.workers.expire(heard):
            log.warning("worker %s missed its heartbeats: considered dead", wid)
        for late in self.queue.expire(now):
            why = late.last_error or "queued"
            await self._fail(late, m.ErrorCode.TIMEOUT, f"not placed before its deadline ({why})")
        live = self.workers.live(heard)
        for role in m.Role:
            self.metrics.live_workers.labels(role.name.lower()).set(sum(w.role == role for w in live))
        while (e := self.queue.head()) is not None:
            s = e.submit
            req = PlacementRequest(s.request_id, s.model, len(s.prompt_ids), s.sampling.max_tokens)
            hits = await self.prefix_hits(s)
            if self.queue.head() is not e:  # cancelled (or expired) while the index answered
                continue
            decision = self._decide(now, req, s, hits)
            if isinstance(decision, Refuse):
                self.queue.remove(e.request_id)
                await self._fail(e, decision.code, decision.message)
                continue
            if not isinstance(decision, Plan):
                e.last_error = decision.reason
                break
            self._start_placement(e, decision)
        self._update_gauges()

    def _take(self, e: Entry, plan: Plan) -> None:
        """Take the entry out of line and count the placement on its workers (before it is sent)."""
        self.queue.start(e.request_id)
        self.workers.note_placement(plan.decode, plan.decode_pages)
        if plan.prefill is not None:
            self.workers.note_placement(plan.prefill, tokens=plan.uncached)
            self._note_prefix(e.submit, plan.prefill)

    def _start_placement(self, e: Entry, plan: Plan) -> None:
        """Take the entry out of line and send it (a task: a reservation waits for its reply)."""
        self._take(e, plan)
        task = asyncio.create_task(self._place(e, plan))
        self._placements.add(task)
        task.add_done_callback(self._placements.discard)

    async def _place(self, e: Entry, plan: Plan) -> None:
        s = e.submit
        queued_s = max(0.0, self.clock() - e.admitted_at)
        attrs = None  # built only for a tracer: a placement without tracing makes no dicts for it
        if self.telemetry.enabled:
            attrs = {**span_attrs.submit(s), "moemesh.placement": plan.kind.value, "moemesh.decode_worker": plan.decode,
                     "moemesh.prefill_worker": plan.prefill or "", "moemesh.queue_seconds": queued_s,
                     "moemesh.attempt": e.attempts + 1}  # fmt: skip
        with self.telemetry.span(
            "scheduler.place", parent=e.traceparent, kind=SpanKind.CONSUMER, attributes=attrs,
            start_time_ns=time.time_ns() - int(queued_s * 1e9),  # the span covers the wait in the queue
        ) as span:  # fmt: skip
            try:
                if plan.kind is PlanKind.DIRECT:
                    msg: Any = m.DecodeDirect(
                        request_id=s.request_id, prompt_ids=s.prompt_ids, sampling=s.sampling,
                        stream_subject=s.stream_subject,
                    )  # fmt: skip
                    # on the socket before this task's bookkeeping and reply (libs.bus write_pending)
                    await self.bus.publish_now(subjects.decode_inbox(plan.decode), msg)
                else:
                    handle = await self._reserve_overlapped(e, plan)
                    if self.queue.is_cancelled(s.request_id):
                        await self.bus.publish(
                            subjects.CANCEL,
                            m.Cancel(request_id=s.request_id, reason="cancelled while placing"),
                        )
                        self.queue.finish(s.request_id)
                        self.metrics.cancelled.inc()
                        span.set_attribute("moemesh.cancelled", True)
                        return
                    assert plan.prefill is not None
                    task = m.PrefillTask(
                        request_id=s.request_id, prompt_ids=s.prompt_ids, sampling=s.sampling,
                        stream_subject=s.stream_subject, handle=handle,
                    )  # fmt: skip
                    await self.bus.publish_now(subjects.prefill_inbox(plan.prefill), task)
                await self.bus.publish(s.stream_subject, placed_notice(s.request_id, plan.decode))
            except _ReservationRefused as err:
                mark_error(span, err)
                self.workers.suspend(plan.decode)
                await self._retry_or_fail(e, str(err))
                return
            except DeadlineExceeded as err:
                mark_error(span, err)
                self.queue.finish(s.request_id)
                await self._fail(e, m.ErrorCode.TIMEOUT, str(err))
                return
            except PayloadTooLarge as err:
                mark_error(span, err)
                self.queue.finish(s.request_id)
                await self._fail(e, m.ErrorCode.BAD_REQUEST, str(err))
                return
            except Exception as err:
                mark_error(span, err)
                log.exception("placing %s failed", s.request_id)
                await self._retry_or_fail(e, f"{type(err).__name__}: {err}")
                return
        self.queue.finish(s.request_id)
        self.metrics.placements.labels(plan.kind.value).inc()
        self.metrics.placement_seconds.observe(self.clock() - e.admitted_at)
        self.wake()

    async def _reserve_overlapped(self, e: Entry, plan: Plan) -> m.KvHandle:
        """_reserve, with the prefill started alongside when overlap_prefill is on."""
        if not self.settings.overlap_prefill or plan.prefill is None:
            return await self._reserve(e, plan)
        s, inbox = e.submit, subjects.prefill_inbox(plan.prefill)
        start = m.PrefillStart(
            request_id=s.request_id,
            prompt_ids=s.prompt_ids,
            sampling=s.sampling,
            stream_subject=s.stream_subject,
        )
        await self.bus.publish_now(inbox, start)
        try:
            return await self._reserve(e, plan)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.bus.publish(inbox, m.PrefillAbandon(request_id=s.request_id))
            raise

    async def _reserve(self, e: Entry, plan: Plan) -> m.KvHandle:
        s = e.submit
        ask = m.ReserveKv(
            stream_subject=s.stream_subject, prefill_worker=plan.prefill or "",
            request_id=s.request_id, num_tokens=plan.num_tokens, lease_ms=self.settings.lease_ms,
            prompt_ids=s.prompt_ids if self.settings.decode_prefix_reuse else [],
        )  # fmt: skip
        try:
            reply: m.ReserveKvReply = await self.bus.request(
                subjects.decode_inbox(plan.decode),
                ask,
                m.ReserveKvReply,
                timeout=self.settings.reserve_timeout_s,
            )
        except DeadlineExceeded:
            raise
        except BusError as err:  # timeout, no responders, Rejected, undecodable reply
            raise _ReservationRefused(f"decode worker {plan.decode}: {err}") from err
        if not reply.ok or reply.handle is None:
            raise _ReservationRefused(f"decode worker {plan.decode} refused: [{reply.code}] {reply.message}")
        return reply.handle

    async def _retry_or_fail(self, e: Entry, error: str) -> None:
        log.info("placement of %s failed (attempt %d): %s", e.request_id, e.attempts + 1, error)
        match self.queue.fail(e.request_id, error):
            case Retry.RETRY:
                self.metrics.retries.inc()
            case Retry.EXHAUSTED:
                await self._fail(
                    e,
                    m.ErrorCode.UNAVAILABLE,
                    f"could not place the request in {e.attempts} attempts: {error}",
                )
            case Retry.GONE:
                self.metrics.cancelled.inc()
        self.wake()

    async def _fail(self, e: Entry, code: int, message: str) -> None:
        """End an admitted request: the gateway ends its stream with this error."""
        self.metrics.refusals.labels(str(int(code))).inc()
        log.info("failing %s: [%d] %s", e.request_id, code, message)
        err = m.RequestError(request_id=e.request_id, code=int(code), message=message)
        try:
            with request_context(traceparent=e.traceparent):
                await self.bus.publish(e.submit.stream_subject, err)
        except Exception as exc:
            log.warning(
                "could not send the error for %s to %s: %s", e.request_id, e.submit.stream_subject, exc
            )

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self.queue.depth)
        self.metrics.placing.set(self.queue.placing)
