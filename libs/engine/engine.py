"""The engine: a model, its paged latent KV pool, a radix prefix cache and continuous batching. Offline:
`Engine.from_pretrained(dir).generate(prompts, SamplingParams(...))`; workers: `add_request` / `step` /
`abort`, and for PD `prefill` (or `add_prefill` + `step`) + `release`, `reserve` + `add_prefilled`."""

# PD: the prompt's KV rows are written into the reserved pages of `kv_pool` from outside, between reserve and
# add_prefilled. Page ownership (pages.py): a request holds one reference on every page in its table, its
# matched prefix pages included (their radix node locked); a reservation holds its pages until add_prefilled
# or cancel_reservation. Every way out (finish, abort, preemption, an exception in generate) drops them, so
# the pool always returns to "free + cached".

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from libs.engine.args import EngineArgs, with_overrides
from libs.engine.batcher import Batcher, Plan, SeqView, pages_for
from libs.engine.config import ModelConfig
from libs.engine.cuda_graph import capture_sizes, decode_graphs_supported
from libs.engine.decode_pipeline import OverlapDecoder
from libs.engine.host_pool import HostKVPool
from libs.engine.kv_fp8 import fp8_rows
from libs.engine.kv_pool import KVPool, row_bytes
from libs.engine.layers.attention_backend import fp8_scales
from libs.engine.loader import load_model
from libs.engine.logits_processors import LogitsProcessors
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.engine.outputs import GenerationOutput, PrefillResult, StepOutput
from libs.engine.page_store import PageStore
from libs.engine.pages import OutOfPagesError, PageAllocator
from libs.engine.radix_cache import CacheListener, PrefixMatch, RadixCache, RadixNode
from libs.engine.request import Request, Status
from libs.engine.runner import Chunk, ModelRunner
from libs.engine.sampling import SampleOutput, SamplingParams, make_generator, sample
from libs.engine.stopping import StopChecker
from libs.engine.store_tier import StoreTier, stats_of
from libs.engine.two_batch_overlap import enable as enable_two_batch_overlap
from libs.engine.validation import Limits, check_prompt, check_token
from libs.tokenizer import Tokenizer

DEFAULT_KV_BYTES = 1 << 30  # default pool size cap when num_pages is 0
_gen_ids = itertools.count()


def default_num_pages(cfg: ModelConfig, page_size: int, max_num_seqs: int, bytes_per_token: int) -> int:
    """Room for max_num_seqs sequences of min(context, 4096) tokens, capped at DEFAULT_KV_BYTES, but
    never less than one sequence of that length."""
    seq = min(cfg.max_position_embeddings, 4096)
    tokens = max(min(max_num_seqs * seq, DEFAULT_KV_BYTES // bytes_per_token), seq)
    return pages_for(tokens, page_size)


class Engine:
    def __init__(
        self, model: DeepseekV3ForCausalLM, args: EngineArgs | None = None, *, tokenizer: Tokenizer | None = None,
        **overrides: Any,
    ) -> None:  # fmt: skip
        """`args` (None: the defaults) with keyword overrides of its fields, as EngineArgs documents them;
        the model is already loaded, so device, dtype, quantization and the EP fields are not read here.
        two_batch_overlap is set before the decode graphs are captured, which happens on first use."""
        self.args = a = with_overrides(args, overrides)
        page_size, max_num_seqs, attention_backend = a.page_size, a.max_num_seqs, a.attention_backend
        self.model = model
        if a.fast_path or (a.fast_path is None and model.device.type == "cuda"):
            model.enable_fast_path()
        self.config: ModelConfig = model.config
        cfg = self.config
        dtype, device = model.dtype, model.device
        scales = fp8_scales(attention_backend, cfg, device, dtype)  # the FP8 row layout its decode kernel reads
        fp8 = fp8_rows(a.kv_cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim, scales)
        token_bytes = row_bytes(cfg.kv_row_dim, dtype, fp8) * cfg.num_hidden_layers
        num_pages = a.num_pages or default_num_pages(cfg, page_size, max_num_seqs, token_bytes)
        graphs = a.cuda_graphs and decode_graphs_supported(model, attention_backend)
        # decode graphs pad their batch with rows that write one scratch page, past the allocator's pages
        pool_pages = num_pages + 1 if graphs else num_pages
        self.kv_pool = KVPool(cfg.num_hidden_layers, pool_pages, page_size, cfg.kv_row_dim, dtype, device, fp8)
        self.page_size = page_size
        self.limits = Limits(cfg.vocab_size, cfg.max_position_embeddings, page_size, num_pages)
        self.allocator = PageAllocator(num_pages)
        host_page_bytes = self.kv_pool.bytes_per_page * cfg.num_hidden_layers
        host_pages = a.host_kv_pages or int(a.host_kv_cache_gb * (1 << 30)) // host_page_bytes
        self.host_pool = HostKVPool(self.kv_pool, host_pages) if a.host_tier and host_pages else None
        self.cache = RadixCache(self.allocator, page_size, self.host_pool) if a.enable_prefix_cache else None
        self.store_tier: StoreTier | None = None  # attach_store
        self.hit_pages = {"device": 0, "host": 0}  # prefix pages requests started from, by tier
        self.host_load_seconds = 0.0  # engine-thread time spent starting host-to-device copies
        # Each eviction walks the whole tree for its LRU leaves: with the pool full of cached prefixes (a
        # serving worker's steady state), evicting at least 1/64 of the pool per walk spreads one walk over
        # many allocations.
        self.evict_min_pages = max(1, num_pages // 64)
        self.batcher = Batcher(page_size, max_num_seqs, a.max_prefill_tokens)
        self.runner = ModelRunner(
            model, self.kv_pool, attention_backend=attention_backend,
            graph_batch_sizes=capture_sizes(max_num_seqs) if graphs else (), scratch_page=num_pages,
        )  # fmt: skip
        if a.two_batch_overlap:
            enable_two_batch_overlap(model, self.runner.backend)
        self.tokenizer = tokenizer
        self.eos_ids: tuple[int, ...] = cfg.eos_token_ids
        if not self.eos_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids = (tokenizer.eos_token_id,)
        self.procs = LogitsProcessors(cfg.vocab_size, device, self.eos_ids, tokenizer)  # penalties, grammars
        self.requests: dict[str, Request] = {}  # every live request, whatever its state
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.pinned: dict[str, Request] = {}  # PD prefill side: prompt pages held until release()
        self.reservations: dict[str, list[int]] = {}  # PD decode side: pages awaiting add_prefilled()
        self._reserved_prefix: dict[str, tuple[RadixNode, int]] = {}  # reservation's locked cached pages
        self._pending: list[StepOutput] = []  # finished outside step(), reported by the next step()
        self._stalled = False  # the last step() had nothing to run and nothing to report
        self.num_preemptions = 0
        self._overlap = OverlapDecoder(self) if a.overlap and self.runner.graphs is not None else None

    @classmethod
    def from_pretrained(cls, path: str | Path, args: EngineArgs | None = None, **overrides: Any) -> Engine:
        """Load a Hugging Face checkpoint folder (on args.device, in args.dtype, as args.quantization says)
        and its tokenizer when tokenizer.json is there; `args` and overrides as __init__ takes them."""
        a = with_overrides(args, overrides)
        model = load_model(path, dtype=a.resolved_dtype, device=a.device, quantization=a.quantization)
        tokenizer = Tokenizer.from_pretrained(path) if (Path(path) / "tokenizer.json").exists() else None
        return cls(model, a, tokenizer=tokenizer)

    # --- offline API ---
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationOutput]:
        """Run every prompt to completion under continuous batching; outputs in prompt order."""
        if self.has_unfinished():
            raise RuntimeError("generate() cannot run while incremental requests are in the engine")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            check_prompt(prompt, p, self.limits, f"prompt {i}")
        rids = [f"gen-{next(_gen_ids)}" for _ in prompts]
        reqs = []
        try:
            for rid, prompt, p in zip(rids, prompts, plist, strict=True):
                self.add_request(rid, prompt, p)
                reqs.append(self.requests[rid])
            while self.has_unfinished():
                if not self.step() and self._stalled:
                    raise RuntimeError(f"engine cannot make progress: {self.stats()}")
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        return [self._generation_output(r) for r in reqs]

    def prefill_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """[T, V] float32 logits at every position of `tokens` (no prefix cache, chunked like prefill)."""
        tokens = check_prompt(tokens, None, self.limits, "tokens")
        pages = self._alloc(pages_for(len(tokens), self.page_size))
        try:
            step = self.batcher.max_prefill_tokens
            parts = [
                self.runner.forward_all(Chunk(list(tokens[s : s + step]), s, pages))
                for s in range(0, len(tokens), step)
            ]
        finally:
            self.allocator.free(pages)
        return torch.cat(parts)

    # --- incremental API ---
    def add_request(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a request; its tokens come out of step(). ValueError on bad input (nothing is queued)."""
        prompt_ids = check_prompt(prompt_ids, params, self.limits, f"request {rid!r}")
        self._check_new_rid(rid)
        req = self._new_request(rid, prompt_ids, params)
        self.requests[rid] = req
        self.waiting.append(req)
        if self.store_tier is not None:
            self.store_tier.prefetch(rid, req.tokens[: req.num_tokens - 1])

    def step(self) -> list[StepOutput]:
        """Plan and run one batch (prefill chunks + one decode token per running request). With overlapped
        decode, a steady decode batch's tokens come out one call after they were computed."""
        store = self.store_tier
        if store is not None:
            store.poll()
        if self._overlap is not None:
            out = self._overlap.try_step()
            if out is not None:
                return out
            self._pending += self._overlap.drain()
        outputs, self._pending = self._pending, []
        plan = self.batcher.schedule(
            [self._view(r) for r in self.running], self._waiting_views(), self._available_pages()
        )
        self._stalled = plan.empty and not outputs
        if self._stalled and store is not None and store.num_pending:
            store.poll(block_s=0.005)  # only store lookups are left: wait for them, not spin
            self._stalled = False
        # Admit before preempting: a preempted request's KV enters the cache and must not lengthen an
        # admitted request's prefix match beyond what the plan was made for.
        for rid in plan.admit:
            self._admit(self.requests[rid])
        for rid in plan.preempt:
            self._preempt(self.requests[rid])
        if not plan.empty:
            outputs += self._run(plan)
        return outputs

    def abort(self, rid: str) -> bool:
        """Drop a request in any state (queued, running, pinned, reserved) and free its pages."""
        if self.store_tier is not None:
            self.store_tier.cancel(rid)
        if rid in self.reservations:
            self.allocator.free(self.reservations.pop(rid))
            if rid in self._reserved_prefix and self.cache is not None:
                self.cache.unlock(self._reserved_prefix.pop(rid)[0])
            return True
        req = self.requests.pop(rid, None) or self.pinned.pop(rid, None)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self.procs.remove(rid)
        req.status = Status.FINISHED
        return True

    @property
    def last_device_wait_s(self) -> float | None:
        """Seconds the last step() spent blocked on the device for the overlapped decode's tokens (a step
        whose host work the device hides waits; one whose host work is longer than the device step does
        not); None without overlapped decode. The plain step's own waits are not counted."""
        return self._overlap.wait_s if self._overlap is not None else None

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._pending)

    def stats(self) -> dict[str, int]:
        return {
            "total_pages": self.allocator.num_pages,
            "free_pages": self.allocator.num_free,
            "used_pages": self.allocator.num_used,
            "cached_pages": self.cache.cached_pages if self.cache else 0,
            "evictable_pages": self.cache.evictable_pages if self.cache else 0,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "pinned": len(self.pinned),
            "reserved": len(self.reservations),
            "max_running": self.batcher.max_num_seqs,
            "preemptions": self.num_preemptions,
            "host_total_pages": self.host_pool.num_pages if self.host_pool else 0,
            "host_used_pages": self.host_pool.num_used if self.host_pool else 0,
            "host_cached_pages": self.cache.host_cached_pages if self.cache else 0,
        }

    def tier_stats(self) -> dict[str, float]:
        """The KV tiers' counters since start (pages, bytes, seconds): hits by tier, copies, store traffic."""
        c = self.cache.counters if self.cache else None
        host_bytes = self.host_pool.page_bytes if self.host_pool else 0
        out: dict[str, float] = {
            "device_hit_pages": self.hit_pages["device"], "host_hit_pages": self.hit_pages["host"],
            "offloaded_bytes": c.offloaded_pages * host_bytes if c else 0,
            "loaded_bytes": c.loaded_pages * host_bytes if c else 0,
            "host_dropped_pages": c.host_dropped_pages if c else 0,
            "host_load_seconds": self.host_load_seconds, "page_bytes": host_bytes,
        }  # fmt: skip
        out.update({f"store_{k}": float(v) for k, v in stats_of(self.store_tier).items()})
        return out

    def attach_store(
        self, store: PageStore, namespace: str, *, timeout_s: float = 1.0, retry_s: float = 5.0,
        max_publish_pages: int = 1024,
    ) -> StoreTier:  # fmt: skip
        """Share cached pages through `store` (libs.engine.store_tier): write-through of new cache pages,
        and a lookup of each new request's uncached prefix. Needs the host tier (pages are staged there)."""
        if self.cache is None or self.host_pool is None:
            raise ValueError("the KV store tier needs the prefix cache and a host tier (host_kv_pages)")
        self.store_tier = StoreTier(
            store, self.cache, namespace, timeout_s=timeout_s, retry_s=retry_s,
            max_publish_pages=max_publish_pages,
        )  # fmt: skip
        return self.store_tier

    def close(self) -> None:
        """Stop the store tier's thread (the engine itself holds nothing to close)."""
        if self.store_tier is not None:
            self.store_tier.close()

    def flush_prefix_cache(self) -> int:
        """Evict every unlocked cached page; returns pages freed."""
        return self.cache.reset() if self.cache else 0

    def set_cache_listener(self, listener: CacheListener | None) -> None:
        """Report prefix-cache block changes (radix_cache.CacheListener) on the thread driving the engine."""
        if self.cache is not None:
            self.cache.set_listener(listener)

    # --- PD disaggregation: prefill side ---
    def prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> PrefillResult:
        """Run a prompt now (reusing the prefix cache) and sample its first token; its pages stay pinned
        (not reused, not evicted) until release(rid), so the caller can copy them out."""
        prompt_ids = check_prompt(prompt_ids, params, self.limits, f"request {rid!r}")
        self._check_new_rid(rid)
        req = self._new_request(rid, prompt_ids, params)
        self.pinned[rid] = req
        try:
            self._admit(req, join_running=False)
            req.pages += self._alloc(pages_for(len(req.prompt_ids), self.page_size) - len(req.pages))
            while req.num_computed < len(req.prompt_ids):
                n = min(len(req.prompt_ids) - req.num_computed, self.batcher.max_prefill_tokens)
                logits = self.runner.forward_last([self._chunk(req, n)])
                req.num_computed += n
            out = self._sample(logits, [req])
        except BaseException:
            self.abort(rid)
            raise
        self._cache_pinned(req)
        return PrefillResult(
            out.token_ids[0], out.logprobs[0], list(req.pages), req.cached_tokens, self._prompt_hashes(req)
        )

    def add_prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a PD prefill that runs through step() with whatever else is queued (sampled as prefill()
        samples); the step that runs its last chunk reports a StepOutput whose `prefill` is its PrefillResult,
        and its pages stay pinned until release(rid). ValueError on bad input."""
        self.add_request(rid, prompt_ids, params)
        self.requests[rid].pin_after_prefill = True

    def prefill_progress(self, rid: str) -> list[int]:
        """The pages of a running add_prefill() prompt whose every row is computed, in prompt order: final, so
        their KV can be copied out while the rest computes. [] for a prompt that waits (a preempted one's
        recompute may use other pages) or that is not in the engine."""
        req = self.requests.get(rid)
        if req is None or req.status is not Status.RUNNING:
            return []
        return req.pages[: req.num_computed // self.page_size]

    @property
    def stalled(self) -> bool:
        """The last step() had nothing to run and nothing to report (e.g. every page is pinned)."""
        return self._stalled

    def release(self, rid: str) -> bool:
        """Unpin a prefilled prompt's pages (after its KV was copied out, or on cancel)."""
        if rid not in self.pinned:
            return False
        return self.abort(rid)

    # --- PD disaggregation: decode side ---
    def reserve(self, rid: str, num_tokens: int) -> list[int]:
        """Allocate pages for a prompt whose KV rows will be written into kv_pool from outside."""
        self._check_new_rid(rid)
        limit = self.config.max_position_embeddings
        if not isinstance(num_tokens, int) or not 1 <= num_tokens <= limit:
            raise ValueError(
                f"reserve: num_tokens must be in 1..{limit} (the context length), got {num_tokens!r}"
            )
        pages = self._alloc(pages_for(num_tokens, self.page_size))
        self.reservations[rid] = pages
        return list(pages)

    def reserve_cached(self, rid: str, prompt_ids: Sequence[int]) -> tuple[int, list[int]]:
        """reserve() for a known prompt, reusing its longest cached whole-page prefix (at least one token left
        to receive): returns (cached tokens, pages for the rest). The cached pages stay locked until
        add_prefilled() joins them or the reservation is cancelled."""
        prompt_ids = check_prompt(prompt_ids, None, self.limits, f"request {rid!r}")
        self._check_new_rid(rid)
        if self.cache is None:
            return 0, self.reserve(rid, len(prompt_ids))
        match = self._take_cached_prefix(self.cache, prompt_ids[:-1])  # before reserve(), which may evict
        try:
            pages = self.reserve(rid, len(prompt_ids) - match.length)
        except BaseException:
            self.cache.unlock(match.node)
            self.allocator.free(match.pages)
            raise
        self.reservations[rid] = list(match.pages) + pages
        self._reserved_prefix[rid] = (match.node, len(match.pages))
        return match.length, pages

    def cancel_reservation(self, rid: str) -> bool:
        return rid in self.reservations and self.abort(rid)

    def add_prefilled(
        self, rid: str, prompt_ids: Sequence[int], first_token: int, params: SamplingParams,
        block_hashes: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """Join the decode batch with the prompt's KV already in the reserved pages; the prefill side's first
        token counts toward max_tokens and stops, and a seeded request continues its random stream, so it
        samples what a single engine would. `block_hashes` (PrefillResult's) are reused if they check out."""
        # A first token that already ends the request is reported by the next step() with no new tokens.
        if rid not in self.reservations:
            raise ValueError(f"add_prefilled: no reservation for request {rid!r}")
        prompt_ids = check_prompt(prompt_ids, params, self.limits, f"request {rid!r}")
        first_token = check_token(first_token, self.limits, "first_token")
        pages = self.reservations[rid]
        if len(pages) * self.page_size < len(prompt_ids):
            raise ValueError(
                f"add_prefilled: {len(pages)} reserved pages cannot hold {len(prompt_ids)} tokens"
            )
        req = self._new_request(rid, prompt_ids, params)
        try:
            self.procs.accept([req], [first_token])
        except ValueError:
            self.procs.remove(rid)
            raise
        req.pages, req.num_computed, req.admitted = self.reservations.pop(rid), len(prompt_ids), True
        req.prompt_hashes = list(block_hashes)
        req.cache_node, req.num_cached_pages = self._reserved_prefix.pop(rid, (None, 0))
        req.status = Status.RUNNING
        self.requests[rid] = req
        self.running.append(req)
        if not params.greedy:  # the prefill side drew the first token from this seed's stream: skip that draw
            torch.empty(self.config.vocab_size, device=self.kv_pool.buffer.device).exponential_(
                generator=req.generator
            )
        reason, stop_reason = req.stopper.check(first_token, 1) if req.stopper else (None, None)
        req.output_ids.append(first_token)
        if reason is not None:
            self._pending.append(self._finish(req, reason, stop_reason, [], None))

    # --- internals: request lifecycle ---
    def _new_request(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        prompt = list(map(int, prompt_ids))
        req = Request(rid, prompt, params, make_generator(params.seed, self.kv_pool.buffer.device))
        req.seed = params.seed if params.seed is not None else secrets.randbits(47)
        req.stopper = StopChecker(params, self.eos_ids, self.tokenizer, prompt)
        self.procs.add(rid, prompt, params)
        return req

    def _admit(self, req: Request, join_running: bool = True) -> None:
        """Start from the longest cached prefix (at least one token is always left to compute)."""
        if self.cache is not None:
            match = self._take_cached_prefix(self.cache, req.tokens[: req.num_tokens - 1])
            req.cache_node, req.pages = match.node, list(match.pages)
            req.num_computed, req.num_cached_pages = match.length, len(match.pages)
        if not req.admitted:
            req.cached_tokens, req.admitted = req.num_computed, True
        req.status = Status.RUNNING
        if join_running:
            self.waiting.remove(req)
            self.running.append(req)

    def _take_cached_prefix(self, cache: RadixCache, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached whole-page prefix of `tokens`, its node locked (not evicted) and its pages
        referenced: the caller unlocks and frees them when done."""
        match = cache.match_prefix(tokens)
        cache.lock(match.node)
        on_device = len(match.pages)
        if match.host_nodes:
            t0 = time.perf_counter()
            match = cache.load_host(match)
            self.host_load_seconds += time.perf_counter() - t0
        self.hit_pages["device"] += on_device
        self.hit_pages["host"] += len(match.pages) - on_device
        self.allocator.incref(match.pages)
        return match

    def _release(self, req: Request) -> None:
        if self.cache is not None and req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        self.allocator.free(req.pages)
        req.pages, req.cache_node, req.num_cached_pages, req.num_computed = [], None, 0, 0

    def _cache_and_release(self, req: Request) -> None:
        if self.cache is not None and req.num_computed:
            self.cache.insert(req.tokens[: req.num_computed], req.pages, req.prompt_hashes)
        self._release(req)

    def _preempt(self, req: Request) -> None:
        """Back to the front of the queue; its KV goes to the prefix cache so recompute is mostly a hit."""
        self.num_preemptions += 1
        self.running.remove(req)
        self._cache_and_release(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _finish(self, req, reason, stop_reason, new_tokens, new_logprobs) -> StepOutput:
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.running.remove(req)
        del self.requests[req.rid]
        self.procs.remove(req.rid)
        self._cache_and_release(req)
        req.status = Status.FINISHED
        return self._step_output(req, new_tokens, new_logprobs)

    def _alloc(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(max(short, self.evict_min_pages))
        if n > self.allocator.num_free:
            raise OutOfPagesError(
                f"out of KV pages: need {n}, {self.allocator.num_free} free of {self.allocator.num_pages} "
                f"after evicting the prefix cache ({self.stats()})"
            )
        return self.allocator.alloc(n)

    def _available_pages(self) -> int:
        return self.allocator.num_free + (self.cache.evictable_pages if self.cache else 0)

    # --- internals: one step ---
    def _view(self, r: Request) -> SeqView:
        return SeqView(r.rid, r.num_computed, r.num_tokens, len(r.pages), r.num_cached_pages, r.in_decode)

    def _waiting_views(self) -> list[SeqView]:
        """Only the requests that could be admitted now are matched against the cache."""
        room = self.batcher.max_num_seqs - len(self.running)
        views = []
        store = self.store_tier
        waiting = self.waiting if store is None else [r for r in self.waiting if not store.pending(r.rid)]
        for r in itertools.islice(waiting, max(room, 0)):
            hit = self.cache.match_prefix(r.tokens[: r.num_tokens - 1]).length if self.cache else 0
            views.append(SeqView(r.rid, hit, r.num_tokens))
        return views

    def _chunk(self, req: Request, n: int) -> Chunk:
        start = req.num_computed
        return Chunk(req.token_slice(start, n), start, req.pages)

    def _run(self, plan: Plan) -> list[StepOutput]:
        items = [(self.requests[rid], n) for rid, n in plan.prefill]
        items += [(self.requests[rid], 1) for rid in plan.decode]
        for req, n in items:
            if req.num_computed + n > req.num_tokens:
                raise RuntimeError(f"plan feeds {req.rid!r} past its last token: {req.num_computed} + {n}")
            # from the request's pages, not the plan's count: a host-tier prefix the plan counted may have
            # been dropped by an earlier admission's load
            req.pages += self._alloc(max(0, pages_for(req.num_computed + n, self.page_size) - len(req.pages)))
        logits_parts, sampled = [], []
        for group in (items[: len(plan.prefill)], items[len(plan.prefill) :]):
            if not group:
                continue
            want = [req.num_computed + n == req.num_tokens for req, n in group]
            chunks = [self._chunk(req, n) for req, n in group]
            if any(want):
                logits_parts.append(self.runner.forward_last(chunks, want))
            else:
                self.runner.forward_last(chunks, want)
            for req, n in group:
                req.num_computed += n
            sampled += [req for (req, _), w in zip(group, want, strict=True) if w]
        if not sampled:
            return []
        # the fused path's raw 16-bit decode logits + fp32 prefill
        same = len({p.dtype for p in logits_parts}) == 1
        logits = torch.cat(logits_parts if same else [p.float() for p in logits_parts])
        out = self._sample(logits, sampled)
        return [
            (self._pin_prefilled if req.pin_after_prefill else self._accept)(req, tok, lp)
            for req, tok, lp in zip(sampled, out.token_ids, out.logprobs, strict=True)
        ]

    def _cache_pinned(self, req: Request) -> None:
        """Cache a pinned prompt's whole pages and lock them there: the prompt holds them until release(),
        so the batcher must not count them as evictable (evicting them would free nothing)."""
        if self.cache is None:
            return
        self.cache.insert(req.prompt_ids, req.pages)
        node = self.cache.match_prefix(req.prompt_ids).node
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _prompt_hashes(self, req: Request) -> list[int]:
        """A pinned prompt's block hashes, from the cache path that holds it (empty when nothing is hashed)."""
        if self.cache is None or req.cache_node is None:
            return []
        return self.cache.path_hashes(req.cache_node)

    def _pin_prefilled(self, req: Request, token: int, logprob) -> StepOutput:
        """An add_prefill() prompt's last chunk ran: out of the batch (never decoded nor preempted), its
        pages pinned and its prompt cached, exactly where prefill() leaves a prompt."""
        self.running.remove(req)
        del self.requests[req.rid]
        self.pinned[req.rid] = req
        self._cache_pinned(req)
        out = self._step_output(req, [token], [logprob] if logprob is not None else None)
        hashes = self._prompt_hashes(req)
        out.prefill = PrefillResult(token, logprob, list(req.pages), req.cached_tokens, hashes)
        return out

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampleOutput:
        """The one place tokens are drawn from the runner's output, one row per request (the timing-model
        engine overrides it): logits processors, then the sampler keyed by (seed, position)."""
        processed = self.procs.apply(logits, reqs)
        out = sample(
            processed, [r.params for r in reqs], [r.generator for r in reqs],
            [(r.seed, r.num_tokens) for r in reqs], logits,
        )  # fmt: skip
        self.procs.accept(reqs, out.token_ids)
        return out

    def _accept(self, req: Request, token: int, logprob) -> StepOutput:
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        assert req.stopper is not None
        reason, stop_reason = req.stopper.check(token, len(req.output_ids))
        lps = [logprob] if logprob is not None else None
        if reason is not None:
            return self._finish(req, reason, stop_reason, [token], lps)
        return self._step_output(req, [token], lps)

    def _step_output(self, req: Request, tokens: list[int], logprobs) -> StepOutput:
        return StepOutput(
            req.rid, tokens, logprobs, req.finished, req.finish_reason, req.stop_reason,
            len(req.prompt_ids), req.cached_tokens,
        )  # fmt: skip

    def _generation_output(self, req: Request) -> GenerationOutput:
        assert req.finish_reason is not None and req.stopper is not None
        text = req.stopper.final_text(req.output_ids, isinstance(req.stop_reason, str))
        return GenerationOutput(
            prompt_token_ids=req.prompt_ids,
            token_ids=req.output_ids,
            finish_reason=req.finish_reason,
            logprobs=req.logprobs if req.params.wants_logprobs else None,
            stop_reason=req.stop_reason,
            text=text,
            cached_tokens=req.cached_tokens,
        )

    # --- internals: validation ---
    def _check_new_rid(self, rid: str) -> None:
        if rid in self.requests or rid in self.pinned or rid in self.reservations:
            raise ValueError(f"request id {rid!r} is already in use")
