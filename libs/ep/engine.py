"""`EPEngine`: the Engine API over a group of EP rank processes (DP attention + EP MoE), for the workers.
Every call must come from one thread (the worker's engine thread); only stats(), has_unfinished() and the
metrics collector may be read from others."""

# The front hands each new request to a rank (rank_routing.py) and sends that request's later calls to the
# same rank; runs group operations (step, prefill, generate, rebalance) on every rank at once, idle ranks
# joining (runtime.py), and merges the outputs; keeps each rank's stats from its last reply, so stats()
# never waits on a rank; sums the expert load and runs EPLB every `eplb_interval_steps` steps, swapping the
# placement in between two steps (requests, their KV and state never move).
# KV pages: global ids, rank r's page p is r * P + p. Without `ep_kv_transfer` (CPU) the ranks' pools are
# slices of one shared-memory pool the front owns (`kv_pool`); with it (GPUs: each pool on its own device)
# every rank registers its own pool (rank_kv.py), and `rank_pools`, `write_kv`, `read_kv` reach them.

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from libs.engine.args import EngineArgs, with_overrides
from libs.engine.config import ModelConfig
from libs.engine.engine import default_num_pages
from libs.engine.kv_fp8 import Fp8Rows, fp8_rows
from libs.engine.kv_pool import KVPool, row_bytes
from libs.engine.layers.attention_backend import fp8_scales
from libs.engine.loader import parse_dtype
from libs.engine.outputs import GenerationOutput, PrefillResult, StepOutput
from libs.engine.sampling import SamplingParams
from libs.ep import eplb
from libs.ep.dispatch.mooncake_ep import DEFAULT_MAX_TOKENS
from libs.ep.group import RankGroup
from libs.ep.placement import Placement
from libs.ep.rank import RankSpec
from libs.ep.rank_routing import RankBlocks, pick_rank
from libs.kvtransfer.ranks import split_rank_pages
from libs.prefix import block_hashes

STAT_KEYS = ("total_pages", "free_pages", "used_pages", "cached_pages", "evictable_pages", "running",
             "waiting", "pinned", "reserved", "preemptions", "max_running")  # fmt: skip
MTP_STAT_KEYS = ("mtp_drafted", "mtp_accepted")  # ranks running MTPEngine


class EPEngine:
    def __init__(self, model_dir: str, args: EngineArgs | None = None, **overrides: Any) -> None:
        """`args` (None: the defaults) with keyword overrides of its fields, as EngineArgs documents them:
        ep_size ranks, each an Engine of num_pages pages and max_num_seqs sequences (0 pages: the default),
        or with mtp_k an MTPEngine; ep_kv_transfer set: every rank registers its own KV pool."""
        a = with_overrides(args, overrides)
        _check_args(a)
        self.config = cfg = ModelConfig.from_pretrained(model_dir)
        if a.mtp_k and cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"mtp_k {a.mtp_k} needs a checkpoint with an MTP layer")
        self.layer_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        if not self.layer_ids:
            raise ValueError(f"{model_dir} has no MoE layers: expert parallelism has nothing to shard")
        self.placement = Placement.uniform(
            len(self.layer_ids), cfg.n_routed_experts, a.ep_size, a.ep_redundant_experts
        )
        self.ep_size, self.page_size, self.eplb_interval_steps = a.ep_size, a.page_size, a.eplb_interval_steps
        torch_dtype = parse_dtype(a.resolved_dtype)
        scales = fp8_scales(a.attention_backend, cfg, a.device, torch_dtype)  # as each rank's Engine picks it
        fp8 = fp8_rows(a.kv_cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim, scales)
        token_bytes = row_bytes(cfg.kv_row_dim, torch_dtype, fp8) * cfg.num_hidden_layers
        self.pages_per_rank = a.num_pages or default_num_pages(cfg, a.page_size, a.max_num_seqs, token_bytes)
        self.args = msgspec.structs.replace(a, num_pages=self.pages_per_rank)
        # CPU: one shared-memory pool, rank r's pages a slice of it
        self._kv_pool = (
            _shared_pool(cfg, a.ep_size * self.pages_per_rank, a.page_size, torch_dtype, fp8)
            if a.device == "cpu" and a.ep_kv_transfer is None
            else None
        )
        shape = (len(self.layer_ids), cfg.n_routed_experts)
        self.expert_load = np.zeros(shape, dtype=np.int64)  # since start, summed over ranks
        self.window_load = np.zeros(shape, dtype=np.int64)  # since the last placement change
        self.num_rebalances, self.steps = 0, 0
        self.owner: dict[str, int] = {}  # request id -> rank
        self.blocks = RankBlocks(a.ep_size)
        self.affinity_slack = max(1, a.max_num_seqs // 16)
        # a file store in a fresh directory: the ranks share a host, and no port can be taken in between
        self._rendezvous = tempfile.mkdtemp(prefix="moemesh-ep-")
        spec = RankSpec(
            model_dir=str(model_dir), init_method=f"file://{self._rendezvous}/store",
            placement=self.placement.to_wire(), engine=self.args,
        )  # fmt: skip
        self.mtp_k = a.mtp_k
        try:
            self.group = RankGroup(spec, self._kv_slices(), a.ep_timeout_s, self._add_load, self.blocks.apply)
            # (Mooncake session, KvGeometry fields) of each rank's own pool
            self.rank_pools: list[tuple[str, dict[str, Any]]] = (
                []
                if a.ep_kv_transfer is None
                else [self.group.call(r, "kv_endpoint") for r in range(a.ep_size)]
            )
        except BaseException:
            if hasattr(self, "group"):
                self.group.close()
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            raise

    # --- offline API ---
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationOutput]:
        """Every prompt to completion; prompts spread over the ranks by length, outputs in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        assign = _spread([len(p) for p in prompts], self.ep_size)
        ops = {
            r: ("generate", ([prompts[i] for i in idx], [plist[i] for i in idx])) for r, idx in assign.items()
        }
        results = self.group.op(ops)
        out: list[GenerationOutput | None] = [None] * len(prompts)
        for r, idx in assign.items():
            for i, o in zip(idx, results[r], strict=True):
                out[i] = o
        return out  # type: ignore[return-value]

    def prefill_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """[T, V] float32 logits at every position, computed on the least loaded rank."""
        r = self._pick()
        return torch.from_numpy(self.group.op({r: ("prefill_logits", (list(tokens),))})[r])

    def prefill_logits_many(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each prompt on rank i mod ep_size, all ranks at once (a ragged batch across the group)."""
        results: list[torch.Tensor | None] = [None] * len(prompts)
        for start in range(0, len(prompts), self.ep_size):
            ops = {
                i - start: ("prefill_logits", (list(prompts[i]),))
                for i in range(start, min(len(prompts), start + self.ep_size))
            }
            got = self.group.op(ops)
            for r in ops:
                results[start + r] = torch.from_numpy(got[r])
        return results  # type: ignore[return-value]

    # --- incremental API (Engine's) ---
    def add_request(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._check_new_rid(rid)
        r = self._pick(prompt_ids)
        self.group.call(r, "add_request", rid, list(prompt_ids), params)
        self.owner[rid] = r

    def step(self) -> list[StepOutput]:
        """One step on every rank (idle ranks serve the others' experts); outputs of all ranks."""
        if not self.has_unfinished():
            return []
        results = self.group.op({r: ("step", ()) for r in range(self.ep_size)})
        outputs = [o for r in range(self.ep_size) for o in results[r]]
        for o in outputs:
            if o.finished:
                self.owner.pop(o.rid, None)
            if o.prefill is not None:  # page ids are global, as prefill() returns them
                o.prefill.page_ids = [p + self.owner[o.rid] * self.pages_per_rank for p in o.prefill.page_ids]
        self.steps += 1
        if self.eplb_interval_steps and self.steps % self.eplb_interval_steps == 0 and self.window_load.any():
            self.rebalance()
        return outputs

    def abort(self, rid: str) -> bool:
        r = self.owner.pop(rid, None)
        return False if r is None else bool(self.group.call(r, "abort", rid))

    def has_unfinished(self) -> bool:
        return any(s.get("unfinished") for s in self.group.status)

    def stats(self) -> dict[str, int]:
        """Summed over ranks, as of each rank's last reply."""
        keys = STAT_KEYS + MTP_STAT_KEYS if self.mtp_k else STAT_KEYS
        return {k: sum(s.get(k, 0) for s in self.group.status) for k in keys}

    def set_cache_listener(self, listener: Any) -> None:
        """Prefix-cache block events of the whole group (radix_cache.CacheListener), on the engine thread:
        a block is stored when the first rank caches it and removed when the last one drops it."""
        self.blocks.set_listener(listener)

    def flush_prefix_cache(self) -> int:
        return sum(self.group.call(r, "flush_prefix_cache") for r in range(self.ep_size))

    # --- PD: prefill side ---
    def prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> PrefillResult:
        """Prefill on the least loaded rank (the others serve its experts); page ids are global."""
        self._check_new_rid(rid)
        r = self._pick(prompt_ids)
        res = self.group.op({r: ("prefill", (rid, list(prompt_ids), params))})[r]
        self.owner[rid] = r
        res.page_ids = [p + r * self.pages_per_rank for p in res.page_ids]
        return res

    def add_prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Engine.add_prefill on the least loaded rank (or the one caching the prompt's prefix)."""
        self._check_new_rid(rid)
        r = self._pick(prompt_ids)
        self.group.call(r, "add_prefill", rid, list(prompt_ids), params)
        self.owner[rid] = r

    def prefill_progress(self, rid: str) -> list[int]:
        """Always []: an EP group reports a prompt's pages only when it is done, so its KV goes whole (asking
        the owning rank after every step would cost a pipe round trip per prompt per step)."""
        return []

    @property
    def stalled(self) -> bool:
        """Every rank's last step had nothing to run and nothing to report."""
        return all(s.get("stalled") for s in self.group.status)

    def release(self, rid: str) -> bool:
        r = self.owner.get(rid)
        if r is None or not self.group.call(r, "release", rid):
            return False
        del self.owner[rid]
        return True

    # --- PD: decode side ---
    def reserve(self, rid: str, num_tokens: int) -> list[int]:
        self._check_new_rid(rid)
        r = self._pick()
        pages = self.group.call(r, "reserve", rid, num_tokens)
        self.owner[rid] = r
        return [p + r * self.pages_per_rank for p in pages]

    def reserve_cached(self, rid: str, prompt_ids: Sequence[int]) -> tuple[int, list[int]]:
        """reserve() on the rank caching most of the prompt's prefix: (cached tokens, global pages for the rest)."""
        self._check_new_rid(rid)
        r = self._pick(prompt_ids)
        cached, pages = self.group.call(r, "reserve_cached", rid, list(prompt_ids))
        self.owner[rid] = r
        return cached, [p + r * self.pages_per_rank for p in pages]

    def cancel_reservation(self, rid: str) -> bool:
        r = self.owner.get(rid)
        if r is None or not self.group.call(r, "cancel_reservation", rid):
            return False
        del self.owner[rid]
        return True

    def add_prefilled(
        self, rid: str, prompt_ids: Sequence[int], first_token: int, params: SamplingParams,
        block_hashes: Sequence[int] = (),
    ) -> None:  # fmt: skip
        r = self.owner.get(rid)
        if r is None:
            raise ValueError(f"add_prefilled: no reservation for request {rid!r}")
        self.group.call(r, "add_prefilled", rid, list(prompt_ids), first_token, params, list(block_hashes))

    @property
    def kv_pool(self) -> KVPool:
        if self._kv_pool is None:
            raise RuntimeError(
                "this EP group keeps a KV pool per rank (on GPUs, each on its own device): there is no one "
                "pool to register; use rank_pools / write_kv / read_kv (built with ep_kv_transfer), which the "
                "workers do"
            )
        return self._kv_pool

    def write_kv(
        self, src_pages: Sequence[int], dst_session: str, dst_geometry: dict[str, Any],
        dst_pages: Sequence[int], num_layers: int,
    ) -> int:  # fmt: skip
        """Write global pages `src_pages` (one request's, so one rank's) from the rank that holds them into
        `dst_pages` of the pool at `dst_session` (KvGeometry fields in `dst_geometry`); bytes written."""
        rank, local = split_rank_pages(src_pages, self.pages_per_rank)
        self._check_rank_pools()
        return int(
            self.group.call(rank, "write_kv", local, dst_session, dst_geometry, list(dst_pages), num_layers)
        )

    def read_kv(self, pages: Sequence[int]) -> np.ndarray:
        """Bytes [L, rows, C*itemsize] of global `pages` (one rank's), read in the rank that holds them."""
        rank, local = split_rank_pages(pages, self.pages_per_rank)
        self._check_rank_pools()
        return self.group.call(rank, "read_kv", local)

    def _check_rank_pools(self) -> None:
        if not self.rank_pools:
            raise RuntimeError(
                "this EP group's ranks have no KV pools of their own (build it with ep_kv_transfer)"
            )

    # --- EPLB ---
    def rebalance(self) -> Placement:
        """New placement by EPLB from the load [L, E] since the last change, applied."""
        load = torch.as_tensor(self.window_load)
        new = eplb.rebalance(load, self.placement.num_physical, self.ep_size, num_groups=self.config.n_group)
        self.apply_placement(new)
        return new

    def apply_placement(self, placement: Placement) -> None:
        """Swap every rank to `placement` between two steps (experts' weights move between ranks)."""
        if placement != self.placement:
            self.group.op({r: ("rebalance", (placement.to_wire(),)) for r in range(self.ep_size)})
            self.placement = placement
            self.num_rebalances += 1
        self.window_load[:] = 0

    def register_metrics(self, registry: Any) -> None:
        from libs.ep.metrics import ExpertLoadCollector

        registry.register(ExpertLoadCollector(self))
        if self.mtp_k:
            from libs.engine.speculative import mtp_collector

            registry.register(
                mtp_collector(lambda: (self.stats()["mtp_drafted"], self.stats()["mtp_accepted"]))
            )

    # --- internals ---
    def _kv_slices(self) -> list[torch.Tensor] | None:
        if self._kv_pool is None:
            return None
        rows = self.pages_per_rank * self.page_size
        return [self._kv_pool.buffer[:, r * rows : (r + 1) * rows] for r in range(self.ep_size)]

    def _add_load(self, load: np.ndarray) -> None:
        self.expert_load += load
        self.window_load += load

    def _pick(self, prompt: Sequence[int] | None = None) -> int:
        """Least busy rank, or the one caching most of `prompt`'s prefix if it is not much busier."""
        status = self.group.status
        busy = [
            s.get("running", 0) + s.get("waiting", 0) + s.get("pinned", 0) + s.get("reserved", 0)
            for s in status
        ]
        free = [s.get("free_pages", 0) + s.get("evictable_pages", 0) for s in status]
        matched = [0] * self.ep_size
        if prompt is not None and self.blocks.refs:
            matched = self.blocks.matched(block_hashes(list(prompt[:-1]), self.page_size))
        return pick_rank(busy, free, matched, self.affinity_slack)

    def _check_new_rid(self, rid: str) -> None:
        if rid in self.owner:
            raise ValueError(f"request id {rid!r} is already in use")

    def close(self) -> None:
        """Stop every rank process (idempotent)."""
        if hasattr(self, "group"):
            self.group.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def __enter__(self) -> EPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _spread(lengths: Sequence[int], n: int) -> dict[int, list[int]]:
    """Prompt indices per rank: longest first, each to the rank with the fewest tokens so far."""
    load = [0] * n
    out: dict[int, list[int]] = {r: [] for r in range(n)}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return {r: sorted(idx) for r, idx in out.items()}


def _shared_pool(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, fp8: Fp8Rows | None
) -> KVPool:
    pool = KVPool(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_row_dim, dtype, fp8=fp8)
    pool.buffer.share_memory_()
    return pool


def _check_args(a: EngineArgs) -> None:
    """What EngineArgs cannot check alone: the backend's own limits."""
    if a.ep_backend == "mooncake":  # low-latency only: every forward must fit its per-rank token limit
        forward_tokens = max(a.max_prefill_tokens, a.max_num_seqs)
        if forward_tokens > DEFAULT_MAX_TOKENS:
            raise ValueError(
                f"EP backend 'mooncake' takes at most {DEFAULT_MAX_TOKENS} tokens per forward: set "
                f"max_prefill_tokens and max_num_seqs <= {DEFAULT_MAX_TOKENS} (one forward here may carry "
                f"{forward_tokens})"
            )
