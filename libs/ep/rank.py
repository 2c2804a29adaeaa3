"""One EP rank as a process: its own Engine (requests, KV pool, prefix cache; DP attention) over a model
whose routed experts are this rank's slots, joined to the group through torch.distributed and driven by
the front (engine.EPEngine) over a pipe with plain tuples, never tensors."""

#   ("call", method, args) -> this rank alone (add_request, abort, reserve, add_prefilled, release, stats,
#                             ...; with EngineArgs.ep_kv_transfer also kv_endpoint, write_kv, read_kv)
#   ("op", name, args)     -> a group operation sent to every rank at once (step, prefill, generate,
#                             rebalance, or idle): each rank does its part, then serves rounds until every
#                             rank is done (runtime.EPRuntime.idle_until_all_done), so collectives line up
#   ("stop",)              -> leave the group and exit
# Replies: ("ok" | "err", result or exception, stats + has-unfinished, expert load since the last reply or
# None, prefix-cache events since the last reply as (stored?, block hashes)). A rank ignores SIGINT/SIGTERM
# (the worker drains first, then stops it) and exits when its pipe closes or its parent forkserver is gone.

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch

from libs.engine.args import EngineArgs
from libs.engine.engine import Engine
from libs.engine.loader import ReadStats
from libs.engine.pages import OutOfPagesError
from libs.engine.tbo_split import decode_round_tokens
from libs.ep.comm import TorchComm
from libs.ep.dispatch.factory import make_dispatcher, resolve_backend
from libs.ep.loader import load_rank_model
from libs.ep.placement import Placement
from libs.ep.rank_kv import RANK_KV_CALLS, RankKv
from libs.ep.runtime import EPRuntime, enable_expert_parallel
from libs.tokenizer import Tokenizer

log = logging.getLogger("moemesh.ep.rank")

CALLS = frozenset(
    {"add_request", "add_prefill", "abort", "reserve", "reserve_cached", "cancel_reservation", "add_prefilled", "release",
     "flush_prefix_cache", "stats"}
)  # fmt: skip


class RankSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a rank process needs to join its group: plain values and the engine's arguments, typed."""

    model_dir: str
    init_method: str  # torch.distributed rendezvous, e.g. "file:///tmp/moemesh-ep-x/store"
    placement: tuple[list[list[int]], int, int]  # Placement.to_wire()
    engine: EngineArgs  # num_pages per rank; ep_kv_transfer set: the rank registers its own KV pool

    @property
    def ep_size(self) -> int:
        return self.engine.ep_size


def rank_device(device: str, rank: int) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"EP ranks run on 'cpu' or 'cuda' (rank r on cuda:r), got device {device!r}")
    return torch.device("cuda", rank)


def rank_main(rank: int, spec: RankSpec, conn: Any, kv_buffer: torch.Tensor | None) -> None:
    """Process entry point."""
    _exit_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s ep-rank-{rank} %(levelname)s %(message)s")
    try:
        worker = RankWorker.start(rank, spec, kv_buffer)
    except BaseException as e:  # the front reports it; nothing else can
        log.exception("rank %d failed to start", rank)
        conn.send(("err", portable(e), None, None, None))
        return
    log.info(
        "EP rank %d/%d ready on %s: %d expert slots per MoE layer, %s dispatch",
        rank, spec.ep_size, rank_device(spec.engine.device, rank), worker.runtime.placement.slots_per_rank,
        spec.engine.ep_backend,
    )  # fmt: skip
    conn.send(("ok", None, worker.status(), None, worker.cache_events.drain()))
    worker.serve(conn)
    # The group is left and the front answered: run multiprocessing's exit hooks (they release this
    # process's semaphores) and skip the interpreter's teardown of torch state, which takes seconds.
    multiprocessing.util._exit_function()  # type: ignore[attr-defined]
    logging.shutdown()
    os._exit(0)


class CacheEvents:
    """The rank engine's prefix-cache listener: keeps the events until the next reply carries them."""

    def __init__(self) -> None:
        self.events: list[tuple[bool, list[int]]] = []

    def blocks_stored(self, hashes: list[int]) -> None:
        self.events.append((True, list(hashes)))

    def blocks_removed(self, hashes: list[int]) -> None:
        self.events.append((False, list(hashes)))

    def drain(self) -> list[tuple[bool, list[int]]]:
        out, self.events = self.events, []
        return out


class RankWorker:
    def __init__(self, rank: int, engine: Engine, runtime: EPRuntime, kv: RankKv | None = None) -> None:
        self.rank, self.engine, self.runtime, self.kv = rank, engine, runtime, kv
        self.cache_events = CacheEvents()
        engine.set_cache_listener(self.cache_events)

    @classmethod
    def start(cls, rank: int, spec: RankSpec, kv_buffer: torch.Tensor | None) -> RankWorker:
        import torch.distributed as dist

        a = spec.engine
        if a.torch_threads:
            torch.set_num_threads(a.torch_threads)
        device = rank_device(a.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=spec.init_method, rank=rank,
            world_size=a.ep_size, timeout=timedelta(seconds=a.ep_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
        comm = TorchComm(None, device)
        placement = Placement.from_wire(spec.placement)
        read, started = ReadStats(), time.monotonic()
        model = load_rank_model(spec.model_dir, placement, rank, a.resolved_dtype, device, a.quantization, read)
        log.info("loaded its weights in %.1f s: %.2f GB in %d tensors from %d shards",
                 time.monotonic() - started, read.bytes / 1e9, read.tensors, len(read.shards))  # fmt: skip
        backend, options = resolve_backend(a.ep_backend, device), {}
        if backend == "fixed":  # buffers for a decode batch; longer forwards take its all-to-all fallback
            # with two-batch overlap, one micro-batch a round
            options["max_tokens"] = decode_round_tokens(a.max_num_seqs, a.two_batch_overlap)
            options["top_k"] = model.config.num_experts_per_tok
        dispatcher = make_dispatcher(
            backend, comm, slots_per_rank=placement.slots_per_rank, num_physical=placement.num_physical,
            hidden=model.config.hidden_size, dtype=model.dtype, fp8=a.ep_fp8_dispatch,
            group=dist.group.WORLD, **options,
        )  # fmt: skip
        runtime = enable_expert_parallel(model, placement, rank, dispatcher, comm)
        tok_file = Path(spec.model_dir) / "tokenizer.json"
        tokenizer = Tokenizer.from_pretrained(spec.model_dir) if tok_file.exists() else None
        engine = _rank_engine(spec, model, tokenizer)
        if kv_buffer is not None:  # this rank's pages of the worker's shared pool
            if kv_buffer.shape != engine.kv_pool.buffer.shape or kv_buffer.dtype != engine.kv_pool.dtype:
                raise ValueError(f"shared KV slice {tuple(kv_buffer.shape)} does not match the rank's pool")
            engine.kv_pool.buffer = kv_buffer
        kv = None if a.ep_kv_transfer is None else RankKv(engine.kv_pool, *a.ep_kv_transfer)
        return cls(rank, engine, runtime, kv)

    def serve(self, conn: Any) -> None:
        import torch.distributed as dist

        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the front is gone
                break
            if msg[0] == "stop":
                conn.send(("ok", None, None, None, None))
                break
            conn.send(self.handle(msg))
        if self.kv is not None:
            self.kv.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def handle(self, msg: tuple) -> tuple:
        kind, name, args = msg
        load = None
        try:
            if kind == "call" and name in RANK_KV_CALLS:
                if self.kv is None:
                    raise ValueError(f"rank {self.rank} has no KV pool of its own on the transfer fabric")
                result = self.kv.handle(name, args)
            elif kind == "call":
                if name not in CALLS:
                    raise ValueError(f"rank call {name!r} is not allowed")
                result = getattr(self.engine, name)(*args)
            elif kind == "op":
                result = self.run_op(name, args)
                load = self.runtime.take_load()
            else:
                raise ValueError(f"unknown message kind {kind!r}")
            return ("ok", result, self.status(), load, self.cache_events.drain())
        except Exception as e:
            if not isinstance(e, ValueError):
                log.exception("rank %d: %s %s failed", self.rank, kind, name)
            return ("err", portable(e), self.status(), load, self.cache_events.drain())

    def run_op(self, name: str, args: tuple) -> Any:
        """This rank's part of a group operation, then idle rounds until every rank has finished its part."""
        self.runtime.begin_op()
        failure: Exception | None = None
        result = None
        try:
            result = self._op(name, args)
        except Exception as e:  # still join the remaining rounds, or the other ranks hang
            failure = e
        self.runtime.idle_until_all_done()
        if failure is not None:
            raise failure
        return result

    def _op(self, name: str, args: tuple) -> Any:
        e = self.engine
        match name:
            case "idle":
                return None
            case "step":
                return e.step()
            case "prefill":
                return e.prefill(*args)
            case "prefill_logits":
                return e.prefill_logits(*args).cpu().numpy()
            case "generate":
                prompts, params = args
                return e.generate(prompts, params) if prompts else []
            case "rebalance":
                self.runtime.apply_placement(Placement.from_wire(args[0]))
                return None
        raise ValueError(f"unknown group operation {name!r}")

    def status(self) -> dict[str, int]:
        e = self.engine
        return {**e.stats(), "unfinished": int(e.has_unfinished()), "stalled": int(e.stalled)}


def _rank_engine(spec: RankSpec, model: Any, tokenizer: Tokenizer | None) -> Engine:
    """The rank's Engine; with mtp_k an MTPEngine whose MTP module holds all its experts and runs them
    locally (no collective: only the target's MoE layers take part in the group's lockstep rounds)."""
    if not spec.engine.mtp_k:
        return Engine(model, spec.engine, tokenizer=tokenizer)
    from libs.engine.models.mtp import load_mtp
    from libs.engine.speculative import MTPEngine

    mtp = load_mtp(spec.model_dir, model, quantization="none")  # dense, as the rank's target is
    return MTPEngine(model, mtp, spec.engine, tokenizer=tokenizer)


_PORTABLE: tuple[type[Exception], ...] = (OutOfPagesError, ValueError, TypeError, TimeoutError, RuntimeError)


def portable(e: BaseException) -> BaseException:
    """A fresh exception of the same well-known kind carrying the text (an arbitrary exception object
    may not survive the pipe to the worker), else a RuntimeError naming the original type."""
    for kind in _PORTABLE:
        if isinstance(e, kind):
            return kind(str(e))
    return RuntimeError(f"{type(e).__name__}: {e}")


def _exit_with_parent() -> None:
    """Leave when the process that forked this rank is gone (the worker is then gone too), even while
    blocked in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)  # liveness poll of the parent process
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
