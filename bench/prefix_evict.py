"""The Engine's steps once its KV pool is full of cached prefixes (a serving worker's steady state): how often
the radix cache evicts, and what its walks cost per step.

    python -m bench.prefix_evict [--num-pages 1024 --running 16 --steps 1500 --prompt-len 40
                                  --shared-prefix 0 --max-tokens 48 --evict-min-pages -1]

The tiny checkpoint on the CPU (the eviction is host work, the same on any device): requests with distinct
random prompts (after a common `--shared-prefix` of tokens, which makes more, smaller leaves), greedy,
`--max-tokens` each, `--running` kept in the batch. Every finished request's pages stay cached, so the pool
fills, then each allocation that finds no free page evicts. Reported over the steps after the pool first
filled: evictions per step, milliseconds of eviction per step, the step's median, the tree's node count.
`--evict-min-pages` sets the Engine's `evict_min_pages` (-1: its default, 1/64 of the pool; 1: what one
allocation lacks, as before 2026-12-03). Writes bench/results/prefix_evict.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import cpu_environment
from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model


def run(a: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(
            write_tiny_model(Path(tmp) / "tiny", seed=0), max_num_seqs=a.running, num_pages=a.num_pages,
            enable_prefix_cache=True,
        )  # fmt: skip
    if a.evict_min_pages >= 0:
        engine.evict_min_pages = max(1, a.evict_min_pages)
    cache = engine.cache
    assert cache is not None
    calls, spent = [0], [0.0]
    evict = cache.evict

    def timed_evict(n: int) -> int:
        t = time.perf_counter()
        try:
            return evict(n)
        finally:
            calls[0] += 1
            spent[0] += time.perf_counter() - t

    cache.evict = timed_evict  # type: ignore[method-assign]
    rnd = random.Random(0)
    vocab = engine.config.vocab_size
    shared = [rnd.randrange(2, vocab) for _ in range(a.shared_prefix)]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    rows, full_at, k = [], None, 0
    for step in range(a.steps):
        while len(engine.running) + len(engine.waiting) < a.running:
            prompt = shared + [rnd.randrange(2, vocab) for _ in range(a.prompt_len - a.shared_prefix)]
            engine.add_request(f"r{k}", prompt, params)
            k += 1
        c0, s0 = calls[0], spent[0]
        t = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t) * 1e3
        if full_at is None and calls[0] > 0:
            full_at = step
        if full_at is not None:
            rows.append((ms, calls[0] - c0, (spent[0] - s0) * 1e3))
    nodes = len(cache._nodes())
    if not rows:
        raise SystemExit("the pool never filled: raise --steps or lower --num-pages")
    return {
        "benchmark": "prefix_evict",
        "command": "python -m bench.prefix_evict " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"),
        "environment": cpu_environment(load_before),
        "evict_min_pages": engine.evict_min_pages,
        "pool_full_from_step": full_at,
        "steps_measured": len(rows),
        "evictions_per_step": sum(r[1] for r in rows) / len(rows),
        "evict_ms_per_step": sum(r[2] for r in rows) / len(rows),
        "evict_ms_per_call": (sum(r[2] for r in rows) / max(1, sum(r[1] for r in rows))),
        "step_ms_p50": statistics.median(r[0] for r in rows),
        "tree_nodes_at_end": nodes,
        "cached_pages_at_end": cache.cached_pages,
        "requests": k,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--running", type=int, default=16)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--evict-min-pages", type=int, default=-1)
    p.add_argument("--out", default="bench/results/prefix_evict.json")
    a = p.parse_args(argv)
    rec = run(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
