"""Worker start-up and liveness: load the engine, expose its KV pool to the transfer fabric and the
kv-broker, publish heartbeats, convert sampling parameters from the wire."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from libs.bus import Bus, Service
from libs.bus.periodic import Periodic
from libs.engine import Engine, SamplingParams
from libs.kvtransfer import KvTransport, make_transport
from libs.worker.engine_thread import EngineThread
from libs.worker.settings import WorkerSettings
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.worker")


def load_engine(s: WorkerSettings) -> Engine:
    """The engine in this process, or with ep_size > 1 the front of a group of EP rank processes
    (libs.ep.engine.EPEngine, the same worker-facing API)."""
    if s.ep_size > 1:
        from libs.ep.engine import EPEngine

        return EPEngine(  # type: ignore[return-value]
            s.model_dir, s.ep_size, device=s.device, dtype=s.dtype, page_size=s.page_size,
            num_pages=s.num_pages or None, max_num_seqs=s.max_num_seqs,
            max_prefill_tokens=s.max_prefill_tokens, enable_prefix_cache=s.enable_prefix_cache,
            backend=s.ep_backend, num_redundant_experts=s.ep_redundant_experts, fp8_dispatch=s.ep_fp8_dispatch,
            torch_threads=s.torch_threads, eplb_interval_steps=s.eplb_interval_steps,
        )  # fmt: skip
    if s.torch_threads and s.device == "cpu":
        import torch

        torch.set_num_threads(s.torch_threads)
    if s.mtp_k:
        from libs.engine.speculative import MTPEngine

        return MTPEngine.load(
            s.model_dir, device=s.device, dtype=s.dtype, num_speculative_tokens=s.mtp_k, page_size=s.page_size,
            num_pages=s.num_pages or None, max_num_seqs=s.max_num_seqs,
            max_prefill_tokens=s.max_prefill_tokens, enable_prefix_cache=s.enable_prefix_cache,
            quantization=s.quantization,
        )  # fmt: skip
    return Engine.from_pretrained(
        s.model_dir, device=s.device, dtype=s.dtype, page_size=s.page_size,
        num_pages=s.num_pages or None, max_num_seqs=s.max_num_seqs,
        max_prefill_tokens=s.max_prefill_tokens, enable_prefix_cache=s.enable_prefix_cache,
        quantization=s.quantization,
    )  # fmt: skip


def register_engine_metrics(engine: Engine, registry: Any) -> None:
    """Metrics the engine exports itself (an EP group: expert load per layer, rank imbalance, rebalances)."""
    register = getattr(engine, "register_metrics", None)
    if register is not None:
        register(registry)


def geometry(engine: Engine) -> m.KvGeometry:
    pool = engine.kv_pool
    return m.KvGeometry(
        num_layers=pool.num_layers, num_pages=pool.num_pages, page_size=pool.page_size,
        page_bytes=pool.bytes_per_page, layer_stride=pool.layer_stride_bytes, base_addr=pool.data_ptr(),
        dtype=str(pool.dtype).removeprefix("torch."),
    )  # fmt: skip


def open_transport(s: WorkerSettings, engine: Engine) -> KvTransport:
    t = make_transport(s.transfer_protocol, s.transfer_hostname, s.transfer_device)
    t.register(engine.kv_pool.data_ptr(), engine.kv_pool.nbytes)
    return t


async def register_at_broker(
    bus: Bus, worker_id: str, role: m.Role, transport: KvTransport, engine: Engine, timeout: float
) -> None:
    msg = m.RegisterWorker(
        worker_id=worker_id, role=role, session_id=transport.session_id, geometry=geometry(engine)
    )
    reply: m.BrokerReply = await bus.request(subjects.BROKER, msg, m.BrokerReply, timeout=timeout)
    if not reply.ok:
        raise RuntimeError(f"kv-broker refused registration of {worker_id}: {reply.message}")


def to_params(s: m.Sampling) -> SamplingParams:
    """Wire sampling -> engine SamplingParams (which validates again: ValueError on bad values)."""
    return SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs, top_logprobs=s.top_logprobs,
    )  # fmt: skip


def to_wire_logprob(lp: Any) -> m.TokenLogprob:
    """engine TokenLogprob -> proto TokenLogprob."""
    top = [m.TopLogprob(int(t), float(v)) for t, v in (lp.top or [])]
    return m.TokenLogprob(int(lp.token_id), float(lp.logprob), top)


class Heartbeater:
    """Publishes WorkerHeartbeat every interval from a stats callback; WorkerGone on stop."""

    def __init__(
        self, bus: Bus, worker_id: str, role: m.Role, model: str, interval_ms: int, stats: Any
    ) -> None:
        self.bus, self.worker_id, self.role, self.model = bus, worker_id, role, model
        self.interval_ms, self.stats = interval_ms, stats
        self.draining = False
        self._periodic = Periodic(interval_ms / 1000, self.beat, "heartbeat")

    def start(self) -> None:
        self._periodic.start()

    async def beat(self) -> None:
        st = self.stats()
        await self.bus.publish(
            subjects.HEARTBEAT,
            m.WorkerHeartbeat(
                worker_id=self.worker_id, role=self.role, model=self.model, running=st["running"],
                waiting=st["waiting"], free_pages=st["free_pages"], total_pages=st["total_pages"],
                page_size=st["page_size"], max_context=st["max_context"], interval_ms=self.interval_ms,
                sent_ms=int(time.time() * 1000), draining=self.draining,
            ),
        )  # fmt: skip

    async def stop(self) -> None:
        await self._periodic.stop()
        with contextlib.suppress(Exception):
            await self.bus.publish(subjects.HEARTBEAT, m.WorkerGone(worker_id=self.worker_id, role=self.role))


class WorkerService(Service):
    """What the prefill and decode worker services share: the engine on its own thread, the KV pool exposed
    to the transfer fabric and announced at the kv-broker (`start_engine`, called first in `setup`)."""

    settings: WorkerSettings
    engine: Any  # libs.engine.Engine, or libs.ep.EPEngine for an EP group
    et: EngineThread
    transport: KvTransport

    async def start_engine(self, role: m.Role) -> None:
        s = self.settings
        subjects.check_token(self.instance_id)
        self.engine = await asyncio.to_thread(load_engine, s)
        self.et = EngineThread(self.engine)
        self.transport = open_transport(s, self.engine)
        await register_at_broker(
            self.bus, self.instance_id, role, self.transport, self.engine, s.broker_timeout_s
        )
