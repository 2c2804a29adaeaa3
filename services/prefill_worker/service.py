"""The prefill worker's bus shell around the engine."""

# Inbox (`proto.subjects.prefill_inbox(id)`): PrefillTask, and with the scheduler's overlap_prefill a
# PrefillStart before it (the prompt is queued into the batch while the decode worker reserves; early.py)
# or PrefillAbandon (the reservation failed). For each PrefillTask: look up the decode worker's pool
# geometry at the kv-broker (cached), run the prompt in the next batched forward of the `PrefillLoop`
# (prefill_loop.py: prompts that arrive together share forwards, prefix cache reused; its pages stay
# pinned), writing its pages into the handle's pages with the transfer engine as they become final
# (kv_stream.py: a long prompt's earlier chunks travel while its later chunks compute; each write a plan of
# merged contiguous runs, off the engine thread), the rest as soon as its own result is back. The first
# token goes to the gateway the moment the prompt's result is back, before the rest of its KV travels; then
# KvReady (first token, already streamed) to the decode worker, the handle marked written, unpin. Failures
# send PrefillFailed to the decode worker and RequestError to the gateway. `Cancel` drops a queued or running task before its KvReady.

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Annotated

import msgspec
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge, Histogram

from libs.bus.periodic import Periodic
from libs.engine.batcher import pages_for
from libs.engine.outputs import PrefillResult
from libs.kvtransfer import PageGeometry, plan_page_runs
from libs.kvtransfer.ranks import sessions, target_pool
from libs.telemetry import RequestTracker
from libs.telemetry import attributes as span_attrs
from libs.worker.heartbeat import Heartbeater
from libs.worker.kv_events import start_kv_events
from libs.worker.page_accounting import install_page_gauges, page_account
from libs.worker.prefix_reuse import first_page_to_send
from libs.worker.rank_pools import has_rank_pools, write_rank_pages
from libs.worker.service import STEP_BUCKETS_S, WorkerService
from libs.worker.settings import WorkerSettings
from libs.worker.startup import geometry, register_engine_metrics
from libs.worker.wire import to_params, to_wire_logprob
from proto import messages as m
from proto import subjects
from services.prefill_worker.early import EarlyPrefills
from services.prefill_worker.kv_stream import KvStream
from services.prefill_worker.prefill_loop import PrefillLoop

log = logging.getLogger("moemesh.prefill")


class Cancelled(Exception):
    """The request was cancelled while its task ran; the decode worker still needs PrefillFailed so it
    frees the reservation (it must not free pages a write may still be landing in before then)."""


class PrefillWorkerSettings(WorkerSettings, frozen=True, kw_only=True):
    lease_margin_ms: Annotated[
        int, msgspec.Meta(description="no KV write starts into a handle whose lease ends sooner than this")
    ] = 1000
    early_prefill_ttl_s: Annotated[
        float,
        msgspec.Meta(
            description="a PrefillStart whose PrefillTask does not come within this many seconds is dropped"
        ),
    ] = 30.0
    max_prefill_prompts: Annotated[
        int, msgspec.Meta(ge=0, description="prompts batched into the engine at once; 0: no limit")
    ] = 0
    attention_backend: Annotated[
        str,
        msgspec.Meta(
            description="auto (the engine's choice on CUDA, triton on CPU), torch, triton or flashinfer"
        ),
    ] = "auto"
    inline_step_max_tokens: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="rounds with at most this many tokens left run on the event loop when the engine is idle; 0: never",
        ),
    ] = 256

    @property
    def engine_attention_backend(self) -> str:
        if self.attention_backend == "auto" and not self.device.startswith("cuda"):
            return "triton"
        return self.attention_backend

    stream_kv: Annotated[
        bool, msgspec.Meta(description="write a long prompt's finished chunks while its later chunks compute")
    ] = True


class PrefillWorker(WorkerService):
    name = "prefill-worker"
    settings_class = PrefillWorkerSettings
    settings: PrefillWorkerSettings

    async def setup(self) -> None:
        s = self.settings
        await self.start_engine(m.Role.PREFILL)
        self.dst_workers: dict[str, m.WorkerRecord] = {}  # decode worker -> its pools, from the broker
        # this worker's own pool (None: an EP engine whose ranks hold the pools and write themselves)
        self.src_geom = None if has_rank_pools(self.engine) else PageGeometry.of_pool(self.engine.kv_pool)
        self.kv_format = geometry(self.engine).dtype  # the row dtype, or fp8_e4m3
        self.active: set[str] = set()  # tasks received and not finished
        self.cancelled: set[str] = set()
        self.attempted: set[str] = set()  # handles a KV write into has begun (PrefillFailed.wrote)
        self._background: set[asyncio.Task] = set()
        r = self.registry
        self.m_tokens = Counter(
            "moemesh_prefill_tokens_total", "prompt tokens prefilled", ["cached"], registry=r
        )
        self.m_seconds = Histogram(
            "moemesh_prefill_seconds", "prefill time per prompt (queued + batched forwards)", registry=r
        )
        self.m_forwards = Counter(
            "moemesh_prefill_forwards_total", "engine forwards (batched prefill steps)", registry=r
        )
        self.m_step = Histogram(
            "moemesh_prefill_step_seconds", "engine step time per batched prefill forward",
            buckets=STEP_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.m_batch = Histogram(
            "moemesh_prefill_batch_prompts", "prompts in the engine per forward", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )  # fmt: skip
        self.prefills = PrefillLoop(
            self.engine, self.et, self._on_step, s.max_prefill_prompts, s.inline_step_max_tokens
        )
        self.m_xfer_bytes = Counter(
            "moemesh_kv_transfer_bytes_total", "KV bytes written to decode workers", registry=r
        )
        self.m_xfer_seconds = Histogram(
            "moemesh_kv_transfer_seconds", "KV transfer time per request", registry=r
        )
        self.m_xfer_early = Counter(
            "moemesh_kv_transfer_early_bytes_total",
            "KV bytes written while the prompt's later chunks were still computing", registry=r,
        )  # fmt: skip
        self.tracker = RequestTracker(self.telemetry, r, "prefill")  # spans + request outcome metrics
        register_engine_metrics(self.engine, r)  # an EP group's expert load
        install_page_gauges(r, self.engine.stats)  # the leak check
        for name, key in (("moemesh_kv_pages_free", "free_pages"), ("moemesh_kv_pages_used", "used_pages")):
            Gauge(name, f"KV pages ({key})", registry=r).set_function(functools.partial(self._stat, key))
        self.kv_events = await start_kv_events(self.bus, self.instance_id, self.et, r)
        self.early = EarlyPrefills(
            functools.partial(self.et.call, self.engine.release), s.early_prefill_ttl_s
        )
        self._early_sweep = Periodic(1.0, self._expire_early, "early-prefill-sweep")
        self._early_sweep.start()
        self.essential(self.prefills.start(), "the prefill loop")
        await self.bus.subscribe(
            subjects.prefill_inbox(self.instance_id), m.PrefillInbox, self.on_inbox, concurrent=True
        )
        await self.bus.subscribe(subjects.CANCEL, m.Cancel, self.on_cancel)
        await self.bus.subscribe(subjects.admin(self.name, self.instance_id), m.AdminRequest, self.on_admin)
        self.heartbeat = Heartbeater(
            self.bus, self.instance_id, m.Role.PREFILL, s.model_name, s.heartbeat_interval_ms, self.load,
            s.stall_dump_s,
        )  # fmt: skip
        self.heartbeat.start()

    def _on_step(self, prompts: int, seconds: float) -> None:
        self.m_forwards.inc()
        self.m_batch.observe(prompts)
        self.m_step.observe(seconds)

    def _stat(self, key: str) -> int:
        return self.engine.stats()[key]

    def load(self) -> dict[str, int]:
        """The heartbeat's numbers: waiting = prompts queued for the engine, running = every other task
        (looking up its destination, in the engine, or transferring), waiting_tokens = prompt tokens not
        yet computed (the scheduler's measure of prefill work ahead)."""
        st = self.engine.stats()
        queued, tokens = self.prefills.backlog()
        return {
            **st,
            "running": max(len(self.active) + len(self.early) - queued, 0),
            "waiting": queued,
            "waiting_tokens": tokens,
            "free_pages": st["free_pages"] + st["evictable_pages"],
            "page_size": self.engine.page_size,
            "max_context": self.engine.config.max_position_embeddings,
        }

    async def on_cancel(self, msg: m.Cancel) -> None:
        if msg.request_id in self.active:
            self.cancelled.add(msg.request_id)
            self.prefills.drop(msg.request_id, Cancelled(msg.request_id))
        self.early.drop(msg.request_id)

    async def on_inbox(self, msg: m.PrefillInbox) -> None:
        match msg:
            case m.PrefillTask():
                await self.on_task(msg)
            case m.PrefillStart(request_id=rid):
                try:
                    params = to_params(msg.sampling)
                except ValueError as e:  # the PrefillTask will fail it with this error
                    log.info("not starting %s early: %s", rid, e)
                    return
                prefill = functools.partial(self.prefills.prefill, rid, msg.prompt_ids, params)
                self.early.start(rid, prefill)
            case m.PrefillAbandon(request_id=rid):
                self.early.drop(rid)

    async def _expire_early(self) -> None:
        self.early.expire()

    async def on_admin(self, msg: m.AdminRequest) -> m.AdminReply:
        st = self.engine.stats()
        stats = m.WorkerStats(
            worker_id=self.instance_id, role=m.Role.PREFILL, running=len(self.active),
            waiting=self.prefills.backlog()[0],
            free_pages=st["free_pages"], total_pages=st["total_pages"], reserved_handles=st["pinned"],
            requests=sorted(self.active), **page_account(st),
        )  # fmt: skip
        return m.AdminReply(ok=True, stats=stats)

    async def _dst_pool(self, handle: m.KvHandle) -> m.KvGeometry:
        """Layout of the pool the handle's pages are in (the decode worker's, or its rank's), looked up at
        the kv-broker once per incarnation of the worker."""
        worker = self.dst_workers.get(handle.decode_worker)
        if worker is None or handle.session_id not in sessions(worker):
            reply: m.BrokerReply = await self.bus.request(
                subjects.BROKER,
                m.LookupWorker(worker_id=handle.decode_worker),
                m.BrokerReply,
                timeout=self.settings.broker_timeout_s,
            )
            if not reply.ok or reply.worker is None:
                raise RuntimeError(
                    f"kv-broker does not know decode worker {handle.decode_worker}: {reply.message}"
                )
            worker = self.dst_workers[handle.decode_worker] = reply.worker
        session, geom = target_pool(worker, handle.decode_rank)
        if session != handle.session_id:  # it restarted since
            raise RuntimeError(
                f"handle {handle.handle_id} names an old incarnation of {handle.decode_worker}"
            )
        if geom.dtype != self.kv_format:  # the broker refuses such pairs at registration; this closes a race
            raise RuntimeError(
                f"KV cache format mismatch: this prefill worker writes {self.kv_format} pages, decode worker "
                f"{handle.decode_worker} holds {geom.dtype}; start both with the same kv_cache_dtype"
            )
        return geom

    async def on_task(self, task: m.PrefillTask) -> None:
        rid = task.request_id
        self.active.add(rid)
        try:
            with self.tracker.request(
                rid, "prefill", span_attrs.prefill_task(task, self.settings.model_name)
            ):
                await self._run(task)
        except Cancelled:
            await self._fail(task, 499, "cancelled", tell_gateway=False)
        except Exception as e:
            code = 400 if isinstance(e, ValueError) else 503
            log.warning("prefill of %s failed: %s", rid, e)
            await self._fail(task, code, str(e))
        finally:
            self.attempted.discard(task.handle.handle_id)
            self.active.discard(rid)
            await self.prefills.release(rid)
            self.cancelled.discard(rid)

    async def _run(self, task: m.PrefillTask) -> None:
        rid, handle = task.request_id, task.handle
        dst = await self._dst_pool(handle)
        self._check_cancelled(rid)
        skip = first_page_to_send(
            pages_for(len(task.prompt_ids), self.engine.page_size), handle, self.engine.page_size
        )
        stream = KvStream(
            functools.partial(self._write_handle, handle.handle_id, handle.session_id, dst), handle.page_ids, skip,
            functools.partial(self._check_writable, task), functools.partial(self.prefills.drop, rid),
        )  # fmt: skip
        if self.settings.stream_kv:
            self.prefills.watch(rid, stream.update)
        try:
            res = await self._prefill(task)
            self._check_writable(task)  # a request about to fail does not stream a token first
            lp = res.logprobs
            first = m.TokenLogprob(res.first_token, 0.0) if lp is None else to_wire_logprob(lp)
            # The first token is final once sampled: the gateway streams it now, before the KV write (TTFT
            # is not the transfer's and the KvReady hop's). The decode worker does not send it again.
            delta = m.TokenDelta(rid, [first.token_id], [first] if task.sampling.logprobs else [], offset=0)
            await self.bus.publish_now(task.stream_subject, m.TokenBatch(deltas=[delta]))
            with self.telemetry.span("kv_transfer", kind=SpanKind.CLIENT) as span:
                t0 = time.perf_counter()
                late = await stream.finish(res.page_ids)  # what is left once the last chunk ran
                protocol, worker = self.settings.transfer_protocol, handle.decode_worker
                span.set_attributes(
                    span_attrs.transfer(protocol, stream.bytes, stream.seconds, stream.runs, worker)
                )
                span.set_attribute("moemesh.kv_transfer.early_bytes", stream.bytes - late)
                span.set_attribute("moemesh.kv_transfer.exposed_seconds", time.perf_counter() - t0)
        finally:
            self.prefills.unwatch(rid)
            await stream.close()  # nothing lands in the decode side's pages after this
        self.m_xfer_seconds.observe(stream.seconds)
        self.m_xfer_bytes.inc(stream.bytes)
        self.m_xfer_early.inc(stream.bytes - late)
        # Unpinning waits in the engine thread's queue behind the next batched step: on_task's `finally`
        # does it after KvReady is out, so the batch does not hold back this first token.
        self._check_cancelled(rid)
        await self.bus.publish(
            subjects.decode_inbox(handle.decode_worker),
            m.KvReady(
                request_id=rid, handle_id=handle.handle_id, prompt_ids=task.prompt_ids, sampling=task.sampling,
                stream_subject=task.stream_subject, first_token=first, cached_tokens=res.cached_tokens,
                prefill_worker=self.instance_id, first_token_streamed=True, block_hashes=res.block_hashes,
            ),
        )  # fmt: skip
        # Off the critical path: KvReady already told the decode worker; the broker's record follows.
        task_ = asyncio.create_task(self._mark_written(handle.handle_id))
        self._background.add(task_)
        task_.add_done_callback(self._background.discard)

    async def _prefill(self, task: m.PrefillTask) -> PrefillResult:
        """The prompt's result from the batched loop (or the early start PrefillStart made), with metrics."""
        rid, t0 = task.request_id, time.perf_counter()
        early = self.early.take(rid)  # started by PrefillStart while the decode worker reserved
        if early is not None:
            res = await early
        else:
            res = await self.prefills.prefill(rid, task.prompt_ids, to_params(task.sampling))
        self.m_seconds.observe(time.perf_counter() - t0)
        self.m_tokens.labels("yes").inc(res.cached_tokens)
        self.m_tokens.labels("no").inc(len(task.prompt_ids) - res.cached_tokens)
        self.tracker.prefix_cache(rid, res.cached_tokens, len(task.prompt_ids))
        return res

    def _check_writable(self, task: m.PrefillTask) -> None:
        """Before each KV write: not cancelled, and the lease far enough from its end (past it the decode
        side may reuse the pages)."""
        self._check_cancelled(task.request_id)
        handle = task.handle
        left_ms = handle.lease_expires_ms - int(time.time() * 1000)
        if left_ms < self.settings.lease_margin_ms:
            raise TimeoutError(f"lease of handle {handle.handle_id} has {left_ms} ms left; not writing")

    def _write_handle(
        self, handle_id: str, session: str, dst: m.KvGeometry, src_pages: list[int], dst_pages: list[int]
    ) -> tuple[int, int]:
        self.attempted.add(handle_id)  # from here on its bytes may land, even if the write fails
        return self._write_pages(session, dst, src_pages, dst_pages)

    def _write_pages(
        self, session: str, dst: m.KvGeometry, src_pages: list[int], dst_pages: list[int]
    ) -> tuple[int, int]:
        """Blocking (a worker thread): every layer of src_pages into dst_pages of the decode worker (or of
        its rank's pool). An EP engine with per-rank pools writes from the rank holding the prompt, through
        the engine thread (libs.worker.rank_pools); runs are then not counted (-1)."""
        if has_rank_pools(self.engine):
            return write_rank_pages(self.engine, self.et, src_pages, session, dst, dst_pages), -1
        assert self.src_geom is not None
        runs = plan_page_runs(self.src_geom.num_layers, src_pages, dst_pages, self.src_geom, dst)
        return self.transport.write(session, runs), len(runs)

    async def _mark_written(self, handle_id: str) -> None:
        try:
            msg, timeout = m.HandleWritten(handle_id=handle_id), self.settings.broker_timeout_s
            reply: m.BrokerReply = await self.bus.request(
                subjects.BROKER, msg, m.BrokerReply, timeout=timeout
            )
            if reply.ok:
                return
            if reply.handle is None or reply.handle.state == m.HandleState.CONSUMED:
                # the usual late arrival: KvReady reached the decode worker first, which consumed the handle
                # (and, done already, may have released it): the write is not in question
                log.debug("HandleWritten(%s) after the decode side took it: %s", handle_id, reply.message)
            else:  # expired: the decode side may be reusing those pages
                log.warning("kv-broker refused HandleWritten(%s): %s", handle_id, reply.message)
        except Exception as e:
            log.warning("kv-broker HandleWritten(%s) failed: %s", handle_id, e)

    def _check_cancelled(self, rid: str) -> None:
        if rid in self.cancelled:
            raise Cancelled(rid)

    async def _fail(self, task: m.PrefillTask, code: int, message: str, tell_gateway: bool = True) -> None:
        hid = task.handle.handle_id
        with contextlib.suppress(Exception):
            await self.bus.publish(
                subjects.decode_inbox(task.handle.decode_worker),
                m.PrefillFailed(
                    request_id=task.request_id, handle_id=hid, message=message, wrote=hid in self.attempted
                ),
            )
            if tell_gateway:
                await self.bus.publish(
                    task.stream_subject,
                    m.RequestError(
                        request_id=task.request_id, code=code, message=message, worker_id=self.instance_id
                    ),
                )

    async def on_drain(self) -> None:
        if getattr(self, "heartbeat", None) is None:  # setup failed before the engine served (logged)
            return
        self.heartbeat.draining = True
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.settings.broker_timeout_s)
        await self._early_sweep.stop()
        await self.early.close()
        await self.heartbeat.stop()
        await self.kv_events.stop()
        await self.prefills.stop()
        self.et.shutdown()
        self.transport.close()
