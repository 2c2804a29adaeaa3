"""One EP rank of a DeepSeek-V3 prefill deployment on one GPU, through the Engine the prefill worker runs:
prompts of 2,000 tokens batched into forwards of a token budget (4k / 8k / 16k), timed as `Engine.step()`.

    python -m bench.prefill_rank [--budgets 4096,8192,16384] [--prompt 2000] [--ep 32 --physical 288]

The Engine is bench.decode_rank's rank engine (DeepSeek-V3's config, random FP8 block-scaled weights,
only this rank's local experts: 9 of 288 at EP-32), EP emulated on one GPU (each token's routed picks
mapped onto the local experts: no dispatch or combine bytes move; that traffic is left out). Prompts join
with `add_request` (max_tokens 1) and the engine's batcher packs them into forwards of up to the budget,
chunking a prompt that does not fit: the MoE takes the grouped FP8 GEMM in the contiguous layout,
attention the backend's expanded-form prefill. tokens/s counts prompt tokens over the wall time of the
steps that prefilled them (first tokens sampled, KV left in the pool). Per budget, `breakdown` times one
more forward by part with bench.part_timer (CUDA events around the MLA blocks, their attention kernel and
the MoE blocks; "other" is the rest of the step), outside the timed rounds.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from bench.decode_rank import build_engine, profile
from bench.harness import environment, write_results
from bench.part_timer import breakdown
from bench.roofline import prefill_bound
from libs.engine.args import KV_CACHE_DTYPES
from libs.engine.presets import deepseek_v3_config
from libs.engine.sampling import SamplingParams


def run_budget(engine, budget: int, prompt: int, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    per_round = max(1, 2 * budget // prompt)  # two forwards' worth of prompts per round
    engine.batcher.max_prefill_tokens = budget
    times, tokens = [], 0
    for r in range(rounds + 1):  # round 0 warms up (kernel choices for these shapes)
        for i in range(per_round):
            ids = [rng.randrange(vocab) for _ in range(prompt)]
            engine.add_request(f"p{budget}-{r}-{i}", ids, SamplingParams(temperature=0, max_tokens=1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
            tokens += per_round * prompt
    secs = sum(times)
    return {"budget": budget, "prompts_per_round": per_round, "tokens": tokens, "seconds": secs,
            "tokens_per_s_per_gpu": tokens / secs}  # fmt: skip


def add_forward(engine, tag: str, budget: int, prompt: int, seed: int) -> None:
    """A budget's worth of random prompts (max_tokens 1), queued for the next forward; the GPU idle after."""
    rng = random.Random(seed)
    for i in range(max(1, budget // prompt)):
        ids = [rng.randrange(engine.config.vocab_size) for _ in range(prompt)]
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()


def part_breakdown(engine, budget: int, prompt: int, seed: int) -> dict:
    """One forward of a budget's worth of prompts under bench.part_timer, outside the timed rounds: ms and
    share of the step for the MLA blocks (with their attention kernel apart), the MoE blocks and the rest."""
    add_forward(engine, f"parts{budget}", budget, prompt, seed)
    rec = breakdown(engine.step)
    while engine.has_unfinished():
        engine.step()
    return {k: round(v, 4) for k, v in rec.items()}


def profile_forward(engine, budget: int, prompt: int, seed: int) -> None:
    """One forward of a budget's worth of prompts under torch.profiler (bench.decode_rank's), outside the timed
    rounds: kernels by CUDA time to profile-prefill-b<budget>.txt beside the records."""
    add_forward(engine, f"prof{budget}", budget, prompt, seed)
    profile(engine, Path(os.environ.get("OUT") or "bench/results") / f"profile-prefill-b{budget}.txt", steps=1)
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="4096,8192,16384")
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument("--physical", type=int, default=288)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attn", choices=["auto", "triton", "flashinfer"], default="auto")
    ap.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                    help="the latent KV cache: auto (bf16) or fp8_e4m3 (FP8 rows, read dequantized by prefill)")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, help="budget to profile one forward of (torch.profiler)")
    a = ap.parse_args()
    budgets = [int(b) for b in a.budgets.split(",")]
    config = deepseek_v3_config(num_hidden_layers=a.layers, max_position_embeddings=a.prompt + 64)
    engine = build_engine(
        config, ep=a.ep, physical=a.physical, max_batch=64, max_ctx=a.prompt + 64, attention=a.attn,
        kv_cache_dtype=a.kv_cache_dtype,
    )
    engine.kv_pool.buffer.zero_()
    env, backend, records = environment(), engine.runner.backend.name, []
    for b in budgets:
        rec = run_budget(engine, b, a.prompt, a.rounds, seed=b)
        rec["breakdown"] = part_breakdown(engine, b, a.prompt, seed=b + 1)
        if a.profile == b:
            profile_forward(engine, b, a.prompt, seed=b + 2)
        roof = prefill_bound(rec["tokens"], a.prompt, ep=a.ep)
        spec = prefill_bound(rec["tokens"], a.prompt, ep=a.ep, peaks="spec")
        rec.update({
            "benchmark": "prefill_rank", "path": "engine", "prompt": a.prompt, "layers": a.layers, "ep": a.ep,
            "local_experts": a.physical // a.ep, "attention_backend": backend, "kv_cache_dtype": a.kv_cache_dtype,
            "ep_communication": "emulated (no bytes moved)",
            "roofline_fraction": roof["step_s"] / rec["seconds"], "roofline_fraction_spec": spec["step_s"] / rec["seconds"],
            **env,
        })  # fmt: skip
        records.append(rec)
        print(f"budget {b}: {rec['tokens_per_s_per_gpu']:.0f} prefill tok/s/GPU ({rec['tokens']} tokens in "
              f"{rec['seconds']:.2f} s); roofline {rec['roofline_fraction']:.2f} measured peaks, "
              f"{rec['roofline_fraction_spec']:.2f} spec [{backend}, EP emulated]", flush=True)  # fmt: skip
        parts = rec["breakdown"]
        print("  one forward of " + ", ".join(f"{p} {parts[p + '_ms']:.1f} ms ({parts[p + '_share']:.0%})"
              for p in ("attention", "attention_kernel", "moe", "other")), flush=True)  # fmt: skip
    suffix = "-fp8kv" if a.kv_cache_dtype != "auto" else ""
    print("wrote", write_results(f"prefill_rank-engine-{backend}{suffix}", records))


if __name__ == "__main__":
    main()
