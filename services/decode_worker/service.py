"""The decode worker's bus shell around the engine: its inbox (proto.subjects.decode_inbox, union DecodeInbox:
ReserveKv, KvReady, DecodeDirect, PrefillFailed, HandleExpired), Cancel and admin; one loop steps the engine
while any request is live and publishes one TokenBatch per (step, gateway)."""

# ReserveKv (request/reply) allocates pages and registers the KV handle at the kv-broker; KvReady joins the
# prefilled request to the batch (its first token streamed by the prefill worker, or here at once when the
# message says it was not); DecodeDirect is prefilled here (conditional disaggregation) in the next step's
# engine-thread call; PrefillFailed / HandleExpired free the reservation.

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Annotated

import msgspec
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge, Histogram

from libs.bus.event_wait import cancel_and_wait, wait_event
from libs.bus.periodic import Periodic
from libs.engine.pages import OutOfPagesError
from libs.engine.sampling import SamplingParams
from libs.telemetry import RequestTracker
from libs.telemetry import attributes as span_attrs
from libs.worker.heartbeat import Heartbeater
from libs.worker.kv_events import start_kv_events
from libs.worker.page_accounting import install_page_gauges, page_account
from libs.worker.prefix_reuse import reserve_for
from libs.worker.rank_pools import handle_place
from libs.worker.service import STEP_BUCKETS_S, WorkerService
from libs.worker.settings import WorkerSettings
from libs.worker.startup import register_engine_metrics
from libs.worker.step_trace import StepTrace
from libs.worker.wire import to_params
from proto import messages as m
from proto import subjects
from services.decode_worker.guard import LeaseBackstop, ReservationGuard
from services.decode_worker.pacing import Action, Pacing
from services.decode_worker.streams import Live, group_by_stream

log = logging.getLogger("moemesh.decode")

Direct = tuple[
    str, list[int], SamplingParams
]  # a direct prompt waiting for the next step: id, prompt, params
NO_ADDS: list[Direct] = []  # a step with no direct prompts (never appended to)


class DecodeWorkerSettings(WorkerSettings, frozen=True, kw_only=True):
    forward_sleep_ms: Annotated[
        float, msgspec.Meta(ge=0, description="slow-down: sleep this long before each step (0: off)")
    ] = 0.0
    overlap_publish: Annotated[
        bool, msgspec.Meta(description="start each step before publishing the previous step's tokens")
    ] = False
    # Bounded because the event loop serves nothing while it runs the step itself.
    inline_step_max_tokens: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="direct prompts of at most this many tokens together that find the worker idle are "
            "stepped on the event loop itself, not the engine thread (0: never)",
        ),
    ] = 256
    step_trace: Annotated[
        str,
        msgspec.Meta(
            description="write each step's timeline as JSON lines to <stem>-<instance id><suffix> of this "
            "path (empty: off)"
        ),
    ] = ""
    kv_write_fence_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description="a reservation whose Mooncake write may still land (its lease ran out while the prefill "
            "worker was still heard, or the write failed midway) keeps its pages until that write is known "
            "complete or this many seconds pass: a partition delays a write, it does not cancel it",
        ),
    ] = 60.0


class DecodeWorker(WorkerService):
    name = "decode-worker"
    settings_class = DecodeWorkerSettings
    settings: DecodeWorkerSettings

    async def setup(self) -> None:
        s = self.settings
        await self.start_engine(m.Role.DECODE)
        self.live: dict[str, Live] = {}
        self.direct: list[Direct] = []  # direct prompts for the next step's engine-thread call
        self.direct_tokens = 0  # their prompt tokens, together
        self.reserved: dict[str, str] = {}  # request id -> handle id (pages reserved, KV not yet joined)
        # Cancelled while reserved: the pages stay until the prefill side answers (KvReady / PrefillFailed)
        # or the lease expires, because a Mooncake write into them may still be landing.
        self.cancelled: set[str] = set()
        self._creates: dict[str, asyncio.Task] = {}  # handle id -> its CreateHandle call at the broker
        self._background: set[asyncio.Task] = set()
        self.pacing = Pacing(s.overlap_publish, s.forward_sleep_ms, s.inline_step_max_tokens)
        self.slowdown_changed = asyncio.Event()  # ends the step loop's slow-down sleep
        self.work = asyncio.Event()  # wakes the step loop; what is pending is `pacing`'s to say
        self._kicked: tuple[asyncio.Future, float] | None = None  # started by start_direct, for the loop
        self.trace = StepTrace.for_worker(s.step_trace, self.instance_id) if s.step_trace else None
        # the last step's (start, end, device wait or -1, GC pauses meanwhile) on the engine thread, for the trace
        self._engine_span = (0.0, 0.0, -1.0, 0.0)
        self.guard = ReservationGuard(self.bus, self.cancelled.add)  # prefill deaths, lease expiry
        await self.guard.start()
        self.leases = (
            LeaseBackstop()
        )  # frees what the broker never expires (a lost CreateHandle/HandleExpired)
        # lease ended, writer still heard: pages held until it answers or the fence passes
        self.fenced = LeaseBackstop()
        self._backstop = Periodic(1.0, self._expire_unanswered, "lease-backstop")
        self._backstop.start()
        self._metrics()
        register_engine_metrics(self.engine, self.registry)  # an EP group's expert load
        self.kv_events = await start_kv_events(self.bus, self.instance_id, self.et, self.registry)
        await self.bus.subscribe(subjects.decode_inbox(self.instance_id), m.DecodeInbox, self.on_inbox)
        await self.bus.subscribe(subjects.CANCEL, m.Cancel, self.on_cancel)
        await self.bus.subscribe(subjects.admin(self.name, self.instance_id), m.AdminRequest, self.on_admin)
        self.heartbeat = Heartbeater(
            self.bus, self.instance_id, m.Role.DECODE, s.model_name, s.heartbeat_interval_ms, self.load,
            s.stall_dump_s,
        )  # fmt: skip
        self.heartbeat.start()
        self.loop_task = self.essential(asyncio.create_task(self._step_loop()), "the step loop")

    def _metrics(self) -> None:
        r = self.registry
        self.m_tokens = Counter("moemesh_decode_tokens_total", "tokens generated", registry=r)
        self.m_step = Histogram(
            "moemesh_decode_step_seconds", "engine step time, hand-off to the engine thread included",
            buckets=STEP_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.m_batch = Gauge("moemesh_decode_running", "requests in the running batch", registry=r)
        self.m_waiting = Gauge("moemesh_decode_waiting", "requests waiting to join the batch", registry=r)
        self.m_free = Gauge("moemesh_kv_pages_free", "free KV pages", registry=r)
        self.m_used = Gauge("moemesh_kv_pages_used", "KV pages in use", registry=r)
        self.tracker = RequestTracker(self.telemetry, r, "decode")  # spans + request outcome metrics
        install_page_gauges(r, self.engine.stats)  # the leak check

    def load(self) -> dict[str, int]:
        st = self.engine.stats()
        self.m_free.set(st["free_pages"])
        self.m_used.set(st["used_pages"])
        self.m_batch.set(st["running"])
        self.m_waiting.set(st["waiting"])
        return {
            **st,
            "free_pages": st["free_pages"] + st["evictable_pages"],
            "page_size": self.engine.page_size,
            "max_context": self.engine.config.max_position_embeddings,
            # reservations whose KV has not joined yet, direct prompts not yet handed to a step
            "pending": st.get("reserved", 0) + len(self.direct),
        }

    # --- inbox ---
    async def on_inbox(self, msg: m.DecodeInbox) -> msgspec.Struct | None:
        match msg:
            case m.ReserveKv():
                attrs = {"moemesh.request_id": msg.request_id, "moemesh.kv.tokens": msg.num_tokens}
                with self.telemetry.span("decode.reserve", kind=SpanKind.SERVER, attributes=attrs):
                    return await self.reserve(msg)
            case m.KvReady():
                await self.join_prefilled(msg)
            case m.DecodeDirect():
                await self.start_direct(msg)
            case m.PrefillFailed(wrote=True):  # a failed write's bytes may still be on their way
                self.fence(msg.request_id, msg.handle_id, f"prefill failed mid-write: {msg.message}")
            case m.PrefillFailed():
                await self.drop_reservation(msg.request_id, msg.handle_id, f"prefill failed: {msg.message}")
            case m.HandleExpired():
                await self.lease_expired(msg.request_id, msg.handle_id)
        return None

    async def reserve(self, msg: m.ReserveKv) -> m.ReserveKvReply:
        rid = msg.request_id
        if self.draining:
            return m.ReserveKvReply(request_id=rid, ok=False, code=503, message="decode worker is draining")
        try:
            cached, pages = await self.et.call(reserve_for, self.engine, msg)
        except OutOfPagesError as e:
            return m.ReserveKvReply(request_id=rid, ok=False, code=429, message=str(e))
        except ValueError as e:
            return m.ReserveKvReply(request_id=rid, ok=False, code=400, message=str(e))
        session, rank, pages = handle_place(self.engine, self.transport, rid, pages)  # the rank holding it
        handle = m.KvHandle(
            handle_id=uuid.uuid4().hex, request_id=rid, decode_worker=self.instance_id,
            session_id=session, page_ids=pages, num_tokens=msg.num_tokens,
            lease_expires_ms=int(time.time() * 1000) + msg.lease_ms, cached_tokens=cached, decode_rank=rank,
        )  # fmt: skip
        if msg.prompt_ids:
            self.tracker.prefix_cache(rid, cached, msg.num_tokens)
        self.reserved[rid] = handle.handle_id
        self.guard.track(rid, msg.prefill_worker, msg.stream_subject)
        self.leases.add(handle.handle_id, rid, time.monotonic() + 2 * msg.lease_ms / 1000)
        # Registered at the broker off the critical path; later broker messages for this handle wait for it.
        self._creates[handle.handle_id] = self._spawn(self._broker_call(m.CreateHandle(handle=handle)))
        return m.ReserveKvReply(request_id=rid, ok=True, handle=handle)

    async def join_prefilled(self, msg: m.KvReady) -> None:
        rid = msg.request_id
        if self.reserved.get(rid) != msg.handle_id:
            log.warning("KvReady for %s (handle %s) without a live reservation: dropped", rid, msg.handle_id)
            return
        if rid in self.cancelled:
            await self.drop_reservation(rid, msg.handle_id, "cancelled before its KV arrived")
            return
        del self.reserved[rid]
        self.guard.untrack(rid)
        model = self.settings.model_name
        self.tracker.start(
            rid, "prefilled", span_attrs.decode_start(msg.prompt_ids, msg.sampling, model, msg.cached_tokens)
        )
        self.live[rid] = Live(msg.stream_subject, len(msg.prompt_ids), msg.cached_tokens, completion_tokens=1)
        if not msg.first_token_streamed:  # stream it now, before the engine step
            first = m.TokenDelta(
                rid, [msg.first_token.token_id], [msg.first_token] if msg.sampling.logprobs else [], offset=0
            )
            await self.bus.publish(
                msg.stream_subject, m.TokenBatch(deltas=[first], worker_id=self.instance_id)
            )
        self.tracker.first_token(rid)
        self.m_tokens.inc()
        try:
            params = to_params(msg.sampling)
            token, hashes = msg.first_token.token_id, msg.block_hashes
            await self.et.call(self.engine.add_prefilled, rid, msg.prompt_ids, token, params, hashes)
        except ValueError as e:
            await self.et.call(self.engine.cancel_reservation, rid)
            self._broker_fire(msg.handle_id, m.ReleaseHandle(handle_id=msg.handle_id, reason="rejected"))
            await self._error(msg.stream_subject, rid, 400, str(e))
            return
        if rid not in self.live:  # cancelled while it was joining
            await self.et.call(self.engine.abort, rid)
        self._wake()
        self._broker_fire(msg.handle_id, m.HandleConsumed(handle_id=msg.handle_id))

    async def start_direct(self, msg: m.DecodeDirect) -> None:
        """Queue the prompt for the next step, added to the engine in that step's own engine-thread call.
        When the step loop is idle that step starts here, before the handler returns."""
        rid = msg.request_id
        self.tracker.start(
            rid, "direct", span_attrs.decode_start(msg.prompt_ids, msg.sampling, self.settings.model_name)
        )
        try:
            params = to_params(msg.sampling)
        except ValueError as e:
            await self._error(msg.stream_subject, rid, 400, str(e))
            return
        self.live[rid] = Live(msg.stream_subject, len(msg.prompt_ids))
        self.direct.append((rid, msg.prompt_ids, params))
        self.direct_tokens += len(msg.prompt_ids)
        self._wake()
        kick = self.pacing.kick(self.direct_tokens)
        if kick is not Action.QUEUE:  # the loop is idle: it takes this step as its own
            self._kicked = self._start_step(inline=kick is Action.INLINE)

    async def lease_expired(self, rid: str, handle_id: str) -> None:
        """The stream moves on at once; the pages wait while the prefill worker is still heard (its write
        may be stalled in the network and land later), until it answers (KvReady / PrefillFailed free
        them) or the write fence passes."""
        if self.reserved.get(rid) != handle_id or handle_id in self.fenced:
            return
        writer = self.guard.holders.holder(rid)  # None once the guard found that worker dead
        if rid not in self.cancelled:
            await self.guard.lost(rid, "the KV lease expired before the prefill side answered")
        watch = self.guard.watch
        if writer and self.settings.kv_write_fence_s > 0 and watch.table.is_alive(writer, watch.clock()):
            self.fence(rid, handle_id, f"lease expired while {writer} is alive")
            return
        await self.drop_reservation(rid, handle_id, "lease expired")

    def fence(self, rid: str, handle_id: str, why: str) -> None:
        """Hold the reservation's pages for kv_write_fence_s (a KvReady still frees them at once)."""
        if self.reserved.get(rid) != handle_id or handle_id in self.fenced:
            return
        self.cancelled.add(rid)
        self.fenced.add(handle_id, rid, time.monotonic() + self.settings.kv_write_fence_s)
        log.info("reservation of %s: pages fenced: %s", rid, why)

    async def _expire_unanswered(self) -> None:
        """A reservation past its backstop ends as if the broker had sent HandleExpired; a fenced one is
        freed once its fence passed."""
        now = time.monotonic()
        for handle_id, rid in self.leases.due(now, lambda r, h: self.reserved.get(r) == h):
            log.warning("reservation of %s: no answer and no HandleExpired past its lease: freeing it", rid)
            await self.on_inbox(m.HandleExpired(handle_id=handle_id, request_id=rid))
        for handle_id, rid in self.fenced.due(now, lambda r, h: self.reserved.get(r) == h):
            log.warning("reservation of %s: no answer from its prefill worker within the write fence", rid)
            await self.drop_reservation(rid, handle_id, "write fence passed")

    async def drop_reservation(self, rid: str, handle_id: str, why: str) -> None:
        if self.reserved.get(rid) != handle_id:
            return
        del self.reserved[rid]
        self.guard.untrack(rid)
        self.cancelled.discard(rid)
        await self.et.call(self.engine.cancel_reservation, rid)
        self._broker_fire(handle_id, m.ReleaseHandle(handle_id=handle_id, reason=why))
        log.info("reservation of %s freed: %s", rid, why)

    async def on_cancel(self, msg: m.Cancel) -> None:
        rid = msg.request_id
        if any(a[0] == rid for a in self.direct):  # not yet in the engine
            self.direct = [a for a in self.direct if a[0] != rid]
            self.direct_tokens = sum(len(a[1]) for a in self.direct)
        if rid in self.reserved:
            self.cancelled.add(rid)  # freed when the prefill side answers or the lease expires
        if self.live.pop(rid, None) is not None:
            self.tracker.finish(rid, "cancelled")
            await self.et.call(self.engine.abort, rid)
            log.info("request %s cancelled: %s", rid, msg.reason)

    async def on_admin(self, msg: m.AdminRequest) -> m.AdminReply:
        match msg:
            case m.SetSlowdown():
                self.pacing.set_slowdown(msg.forward_sleep_ms)
                self.slowdown_changed.set()
                self._wake()
        return m.AdminReply(ok=True, stats=self.worker_stats())

    def worker_stats(self) -> m.WorkerStats:
        st = self.engine.stats()
        return m.WorkerStats(
            worker_id=self.instance_id, role=m.Role.DECODE, running=st["running"], waiting=st["waiting"],
            free_pages=st["free_pages"], total_pages=st["total_pages"], reserved_handles=len(self.reserved),
            requests=sorted(self.live), forward_sleep_ms=self.pacing.sleep_ms, **page_account(st),
        )  # fmt: skip

    # --- the step loop ---
    def _step_once(self, adds: list[Direct]) -> tuple[list, bool, dict[str, tuple[int, str]] | None]:
        """On the engine thread: add the direct prompts queued since the last step, then one step. A prompt
        the engine refuses fails alone (400 for a ValueError, else 500; in the third item), not the batch."""
        refused: dict[str, tuple[int, str]] | None = None
        for rid, prompt, params in adds:
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:
                if refused is None:
                    refused = {}
                refused[rid] = (
                    (400, str(e)) if isinstance(e, ValueError) else (500, f"{type(e).__name__}: {e}")
                )
        engine = self.engine
        if self.trace is None:
            return (engine.step() if engine.has_unfinished() else []), engine.has_unfinished(), refused
        t_in, gc_in = time.perf_counter(), self.gc_pauses.total_s
        outputs = engine.step() if engine.has_unfinished() else []
        wait = getattr(engine, "last_device_wait_s", None)  # the Engine's; other engines have none
        gc_s = self.gc_pauses.total_s - gc_in  # any thread's collection stopped this one too
        self._engine_span = (t_in, time.perf_counter(), -1.0 if wait is None else wait, gc_s)
        return outputs, engine.has_unfinished(), refused

    def _wake(self) -> None:
        """Work for the step loop: its next step takes it."""
        self.pacing.wake()
        self.work.set()

    def _start_step(self, inline: bool = False) -> tuple[asyncio.Future, float]:
        """Hand the engine thread the next step with the direct prompts queued since the last one; with
        inline, run it here if the engine thread is idle (the future comes back done)."""
        adds = self.direct
        if adds:
            self.direct, self.direct_tokens = [], 0
        else:
            adds = NO_ADDS  # not self.direct: the engine thread must not see prompts queued from now on
        t0 = time.perf_counter()
        step = self.et.run_inline(self._step_once, adds) if inline else None
        return (step if step is not None else self.et.submit(self._step_once, adds)), t0

    async def _step_loop(self) -> None:
        """Runs what `pacing` decides: wait for work, sleep (slow-down), start or take a step, await it, then
        publish its tokens (with overlap_publish, after starting the next step)."""
        pacing = self.pacing
        running: tuple[asyncio.Future, float] | None = None
        while True:
            action = pacing.next()
            if action is Action.WAIT:
                if self.trace is not None:
                    self.trace.flush()  # idle: the rows so far are on disk for whoever reads them
                self.work.clear()
                await self.work.wait()
                continue
            if action is Action.SLEEP:
                self.slowdown_changed.clear()
                await wait_event(self.slowdown_changed, pacing.sleep_ms / 1000)
                continue
            if action is Action.STEP:
                running = self._start_step()
            elif action is Action.TAKE:
                running, self._kicked = self._kicked, None
            assert running is not None  # AWAIT: the step started before the last publish
            step, t0 = running
            running = None
            try:
                outputs, more, refused = await step
            except Exception as e:  # a failed step fails its batch, never the worker
                log.exception("engine step failed")
                pacing.failed()
                await self._fail_all(500, f"decode step failed: {e}")
                continue
            seen = time.perf_counter()
            self.m_step.observe(seen - t0)
            sleep_ms, span = pacing.sleep_ms, self._engine_span  # before a next step overwrites the span
            if pacing.finished(more, bool(self.direct)) is Action.STEP:
                running = self._start_step()
            if refused:
                for rid, (code, why) in refused.items():
                    if (live := self.live.get(rid)) is not None:
                        await self._error(live.stream_subject, rid, code, why)
            try:
                await self._publish(outputs)
            except Exception:  # the bus went away mid-publish: gateways migrate their streams
                log.exception("publishing a step's tokens failed")
            if self.trace is not None:
                self._trace_step(t0, span, seen, outputs, sleep_ms)

    def _trace_step(
        self, t0: float, span: tuple[float, float, float, float], seen: float, outputs: list, sleep_ms: float
    ) -> None:
        """The step's row in the step trace (setting step_trace)."""
        assert self.trace is not None
        e_in, e_out, wait, gc_s = span
        tokens = sum(len(o.token_ids) for o in outputs)
        self.trace.add(t0, e_in, e_out, seen, time.perf_counter(), len(outputs), tokens, sleep_ms, wait, gc_s)

    async def _publish(self, outputs: list) -> None:
        """One TokenBatch per gateway, handed to the socket at once; then first-token and finish bookkeeping."""
        if not outputs:
            return
        for subject, deltas in group_by_stream(outputs, self.live).items():
            await self.bus.publish(subject, m.TokenBatch(deltas=deltas, worker_id=self.instance_id))
        self.bus.write_pending()  # the batches go to the socket now, not after the bookkeeping below
        tokens = 0
        for out in outputs:
            n = len(out.token_ids)
            tokens += n
            if (live := self.live.get(out.rid)) is None:
                continue
            if n and live.completion_tokens == n:  # its first tokens (a prefilled one's came with KvReady)
                self.tracker.first_token(out.rid)
            if out.finished:
                del self.live[out.rid]
                self.tracker.finish(
                    out.rid, out.finish_reason or "stop", output_tokens=live.completion_tokens
                )
        self.m_tokens.inc(tokens)  # one locked update per step

    async def _fail_all(self, code: int, message: str) -> None:
        for rid, live in list(self.live.items()):
            with contextlib.suppress(Exception):
                await self.et.call(self.engine.abort, rid)
            await self._error(live.stream_subject, rid, code, message)
        self.live.clear()

    async def _error(self, subject: str, rid: str, code: int, message: str) -> None:
        self.live.pop(rid, None)
        self.tracker.finish(rid, "error", error=f"[{code}] {message}")
        with contextlib.suppress(Exception):
            await self.bus.publish(subject, m.RequestError(request_id=rid, code=code, message=message))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _broker_call(self, msg: msgspec.Struct, after: asyncio.Task | None = None) -> None:
        if after is not None:
            with contextlib.suppress(Exception):
                await after
        try:
            timeout = self.settings.broker_timeout_s
            reply: m.BrokerReply = await self.bus.request(
                subjects.BROKER, msg, m.BrokerReply, timeout=timeout
            )
            if not reply.ok:
                log.warning("kv-broker refused %s: %s", type(msg).__name__, reply.message)
        except Exception as e:
            log.warning("kv-broker %s failed: %s", type(msg).__name__, e)

    def _broker_fire(self, handle_id: str, msg: msgspec.Struct) -> None:
        """Tell the broker, in the background, once this handle's CreateHandle has been answered."""
        self._spawn(self._broker_call(msg, after=self._creates.pop(handle_id, None)))

    async def on_drain(self) -> None:
        """Finish the running batch (up to the drain timeout), then end what is left with 503."""
        if getattr(self, "heartbeat", None) is None:  # setup failed before the engine served (logged)
            return
        self.heartbeat.draining = True
        with contextlib.suppress(Exception):
            await self.heartbeat.beat()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.live and not self.loop_task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the step loop is running the batch down (none left to: fail them now)
        await self._fail_all(503, "decode worker shut down")
        for rid, handle_id in list(self.reserved.items()):
            await self.drop_reservation(rid, handle_id, "decode worker shut down")
        await cancel_and_wait(self.loop_task)  # again while it runs on: a cancel lost in nats-py's wait_for
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.settings.broker_timeout_s)
        await self.heartbeat.stop()
        await self._backstop.stop()
        await self.guard.stop()
        await self.kv_events.stop()
        self.et.shutdown()
        self.transport.close()
