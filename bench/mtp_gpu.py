"""MTP speculative decoding at DeepSeek-V3 width on one GPU: draft + verify step time (`python -m bench.mtp
--gpu`; options in bench/mtp.py).

The model is DeepSeek-V3's config (libs.engine.presets) cut to --layers decoder layers (the first three
dense, the rest MoE with all 256 routed experts), plus one MTP module (a full V3 MoE block, sharing the
target's embedding and head as DeepSeek's checkpoints do), random FP8 block-scaled weights
(libs.engine.random_weights). B requests join as a decode worker's do (reserve + add_prefilled: prompt KV
in the pool), contexts of --ctx tokens, greedy. Per (B, k):

- `step_ms`: `MTPEngine.step()` wall time, median: scheduling, the verify forward over B * (k + 1) rows,
  acceptance, the MTP extend over the verified rows and k - 1 chained MTP steps, all replayed from CUDA
  graphs (libs/engine/spec_graphs.py); `verify_graph_ms` / `draft_graph_ms`: the verify graph of B * (k+1)
  rows and one MTP draft graph of B rows replayed alone (CUDA events, median);
- `syncs_per_step`: synchronizing CUDA calls per step (torch.cuda.set_sync_debug_mode "warn", 4 more
  steps): the host waits for the device at each;
- `plain_step_ms`: the plain Engine's decode step at the same B (k 0: decode graph, overlapped);
- `break_even_tokens_per_step` = step_ms / plain_step_ms: the tokens a step must yield (1 + accepted
  drafts) for MTP to pay off. Random weights accept no drafts, so this is the cost side only; the
  acceptance a trained model reaches (DeepSeek-V3 report: 85-90% for the second token) says what it buys.
"""

from __future__ import annotations

import gc
import math
import random
import time
import warnings
from typing import Any, cast

import torch

from bench.harness import environment, graph_ms, write_results
from libs.engine.config import ModelConfig
from libs.engine.engine import Engine
from libs.engine.layers.fp8_linear import apply_fp8_weights
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.engine.models.mtp import MTPLayer
from libs.engine.presets import deepseek_v3_config
from libs.engine.random_weights import fill_random_
from libs.engine.sampling import SamplingParams
from libs.engine.speculative import MTPEngine
from libs.engine.tiny import is_fp8_weight

PAGE = 64


class _FP8Names:
    """The weight names DeepSeek's FP8 checkpoint stores in FP8 (projections; not the head or the router)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and is_fp8_weight(name)


def build_models(
    config: dict, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> tuple[DeepseekV3ForCausalLM, MTPLayer]:
    """The target and its MTP module from a DeepSeek config.json dict, random FP8 weights, on `device`."""
    cfg = ModelConfig.from_dict(config)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg, dtype, device)
        mtp = MTPLayer(cfg, model.rope, dtype, device)
    for m in (model, mtp):
        apply_fp8_weights(m, cast(Any, _FP8Names()), (128, 128))
    fill_random_(model, seed)
    fill_random_(mtp, seed + 1)
    mtp.embed_tokens = model.model.embed_tokens  # shared, as in DeepSeek's checkpoints
    mtp.shared_head.head.weight = model.lm_head.weight
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model, mtp.eval()


def _fill(engine: Engine, b: int, ctx: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    for i in range(b):
        rid = f"b{b}-{i}"
        engine.reserve(rid, ctx)
        room = min(256, engine.config.max_position_embeddings - ctx)  # more than the steps timed
        params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
        engine.add_prefilled(rid, [rng.randrange(vocab) for _ in range(ctx)], rng.randrange(vocab), params)


def _step_ms(engine: Engine, b: int, warmup: int, iters: int) -> float:
    for _ in range(warmup):  # graph captures (and overlapped decode's first, empty step) happen here
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        assert len(out) == b, (len(out), b)
    return sorted(times)[iters // 2]


def _syncs_per_step(engine: Engine, steps: int) -> float | None:
    """Synchronizing CUDA calls per step over `steps` more steps (torch's sync debug mode warns on each
    one it covers: tolist/item, blocking copies); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return round(sum("synchroniz" in str(w.message).lower() for w in caught) / steps, 2)


def _replay_ms(runner, rows: int, iters: int) -> float | None:
    fits = [s for s in runner.captured if s >= rows] if runner is not None else []
    if not fits:
        return None
    graph = runner._graphs[min(fits)].graph
    return sorted(graph_ms(graph, iters))[iters // 2]


def measure(
    model, mtp, b: int, k: int, *, ctx: int, attn: str, warmup: int, iters: int, page_size: int = PAGE
) -> dict:
    """One (batch, k) record; k 0 is the plain Engine."""
    kw: dict[str, Any] = dict(
        page_size=page_size, num_pages=b * math.ceil((ctx + 256) / page_size), max_num_seqs=b,
        enable_prefix_cache=False, attention_backend=attn,
    )  # fmt: skip
    if k == 0:
        engine: Engine = Engine(model, **kw)
    else:
        engine = MTPEngine(model, mtp, mtp_k=k, **kw)
    engine.kv_pool.buffer.normal_()  # as if prompts had been prefilled: attention reads real-looking rows
    _fill(engine, b, ctx, seed=b)
    step = _step_ms(engine, b, warmup, iters)
    row: dict[str, Any] = {
        "batch": b,
        "k": k,
        "step_ms": round(step, 3),
        "syncs_per_step": _syncs_per_step(engine, 4),
    }
    if isinstance(engine, MTPEngine):
        row["verify_graph_ms"] = _replay_ms(engine.verify_graphs, b * (k + 1), iters)
        row["draft_graph_ms"] = _replay_ms(engine.draft_graphs, b, iters)
        row["acceptance_rate"] = round(engine.acceptance_rate, 3)
        row["cuda_graphs"] = engine.verify_graphs is not None and engine.draft_graphs is not None
    else:
        row["cuda_graphs"] = engine.runner.graphs is not None
    for rid in list(engine.requests):
        engine.abort(rid)
    del engine
    gc.collect()  # the engine's graph runners hold bound methods of it: a cycle
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run(a) -> dict:
    batches = [int(x) for x in a.batches.split(",")]
    ks = sorted({0, *(int(k) for k in a.ks.split(","))})
    t0 = time.perf_counter()
    model, mtp = build_models(
        deepseek_v3_config(num_hidden_layers=a.layers, max_position_embeddings=a.ctx + 1024)
    )
    build_s = time.perf_counter() - t0
    rows = []
    for b in batches:
        base = None
        for k in ks:
            row = measure(model, mtp, b, k, ctx=a.ctx, attn=a.attn, warmup=a.warmup, iters=a.iters)
            base = row["step_ms"] if k == 0 else base
            if k and base:
                row["plain_step_ms"] = base
                row["break_even_tokens_per_step"] = round(row["step_ms"] / base, 3)
            rows.append(row)
            print(row, flush=True)
    return {
        "benchmark": "mtp", "mode": "gpu", "model": f"DeepSeek-V3 width, {a.layers} layers + MTP, random FP8",
        "ctx": a.ctx, "layers": a.layers, "attention_backend": a.attn, "build_s": round(build_s, 1),
        "environment": environment(), "results": rows,
    }  # fmt: skip


def main(a) -> None:
    result = run(a)
    print("wrote", write_results(f"mtp-gpu-{a.attn}", [result]))
