"""Worker start-up: load the engine (one process, or the front of an EP rank group), expose its KV pool to
the transfer fabric and announce it at the kv-broker."""

from __future__ import annotations

from typing import Any

import torch

from libs.bus import Bus
from libs.engine import Engine
from libs.engine.args import EngineArgs
from libs.engine.protocol import EngineLike
from libs.ep.engine import EPEngine
from libs.kvtransfer import KvTransport, MooncakeTransport, SkipTransport, make_transport
from libs.worker.rank_pools import has_rank_pools, rank_pools
from libs.worker.settings import WorkerSettings
from proto import messages as m
from proto import subjects


def engine_args(s: WorkerSettings) -> EngineArgs:
    """The engine's arguments from a worker's settings (an EP group's ranks run the auto attention backend)."""
    kv_transfer = (s.transfer_protocol, s.transfer_hostname, s.transfer_device) if s.kv_per_rank else None
    return EngineArgs(
        page_size=s.page_size, num_pages=s.num_pages, max_num_seqs=s.max_num_seqs,
        max_prefill_tokens=s.max_prefill_tokens, enable_prefix_cache=s.enable_prefix_cache,
        kv_cache_dtype=s.kv_cache_dtype, host_kv_pages=s.host_kv_pages, host_kv_cache_gb=s.host_kv_cache_gb,
        device=s.device, dtype=s.dtype, quantization=s.quantization,
        attention_backend=s.engine_attention_backend if s.ep_size == 1 else "auto", torch_threads=s.torch_threads,
        two_batch_overlap=s.two_batch_overlap, mtp_k=s.mtp_k, ep_size=s.ep_size, ep_backend=s.ep_backend,
        ep_redundant_experts=s.ep_redundant_experts, ep_fp8_dispatch=s.ep_fp8_dispatch,
        eplb_interval_steps=s.eplb_interval_steps, ep_kv_transfer=kv_transfer,
    )  # fmt: skip


def load_engine(s: WorkerSettings) -> EngineLike:
    """The engine in this process, or with ep_size > 1 the front of a group of EP rank processes
    (libs.ep.engine.EPEngine, the same worker-facing API), or with engine=sim the timing-model engine."""
    args = engine_args(s)
    if s.engine == "sim":
        from libs.sim import sim_engine

        return sim_engine(s, args)
    # The grammar engine's import holds the GIL for seconds: done here, before heartbeats start, rather
    # than on the first structured-output request (which would stall the event loop past liveness).
    import libs.engine.grammar  # noqa: F401

    if args.ep_size > 1:
        return EPEngine(s.model_dir, args)
    if args.torch_threads and args.device == "cpu":
        torch.set_num_threads(args.torch_threads)
    if args.mtp_k:
        from libs.engine.speculative import MTPEngine

        return MTPEngine.load(s.model_dir, args)
    return Engine.from_pretrained(s.model_dir, args)


def register_engine_metrics(engine: EngineLike, registry: Any) -> None:
    """Metrics the engine exports itself (an EP group: expert load per layer, rank imbalance, rebalances)."""
    register = getattr(engine, "register_metrics", None)
    if register is not None:
        register(registry)


def geometry(engine: EngineLike) -> m.KvGeometry:
    pools = rank_pools(engine)
    if pools:  # per-rank pools: the worker's own fields carry rank 0's
        return pools[0].geometry
    pool = engine.kv_pool
    return m.KvGeometry(
        num_layers=pool.num_layers, num_pages=pool.num_pages, page_size=pool.page_size,
        page_bytes=pool.bytes_per_page, layer_stride=pool.layer_stride_bytes, base_addr=pool.data_ptr(),
        dtype=pool.format_name,
    )  # fmt: skip


def open_transport(s: WorkerSettings, engine: EngineLike) -> KvTransport:
    if has_rank_pools(engine):  # each rank registered its own pool; this process moves no KV itself
        return SkipTransport()
    t = make_transport(s.transfer_protocol, s.transfer_hostname, s.transfer_device)
    buffer = getattr(engine.kv_pool, "buffer", None)  # the sim engine's pool holds no tensor
    device = buffer.device if isinstance(buffer, torch.Tensor) else torch.device("cpu")
    if device.type == "cuda" and isinstance(t, MooncakeTransport):
        t.bind_cuda_device(device.index if device.index is not None else torch.cuda.current_device())
    t.register(engine.kv_pool.data_ptr(), engine.kv_pool.nbytes)
    return t


async def register_at_broker(
    bus: Bus, worker_id: str, role: m.Role, transport: KvTransport, engine: EngineLike, timeout: float
) -> None:
    pools = rank_pools(engine)
    msg = m.RegisterWorker(
        worker_id=worker_id, role=role, session_id=pools[0].session_id if pools else transport.session_id,
        geometry=geometry(engine), ranks=pools,
    )  # fmt: skip
    reply: m.BrokerReply = await bus.request(subjects.BROKER, msg, m.BrokerReply, timeout=timeout)
    if not reply.ok:
        raise RuntimeError(f"kv-broker refused registration of {worker_id}: {reply.message}")
