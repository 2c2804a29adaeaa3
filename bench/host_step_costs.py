"""Host-side costs of a decode step at a served batch, on any machine (no GPU): the project's own functions.

    python -m bench.host_step_costs [--batch 256] [--context 2090] [--iters 200]

- fill_full / fill_memo: `fill_decode_inputs` (libs/engine/cuda_graph.py), the decode graph's input fill, for
  `batch` rows of `context` tokens (16-token pages) as a steady batch grows token by token: every table row
  written each step (no memo) against the graph's memo of the rows' page lists (only new pages written);
- fill_full_churn / fill_memo_churn: the same with one request finishing in the middle of the batch and one
  joining at its end every step (the rows after the finish move up one);
- extend_hashes: block hashes of one finished `context`-token sequence (libs/prefix/hashing.py), what a decode
  worker computes for each finished request when it caches it;
- cache_insert: that sequence's RadixCache.insert with a KV-event listener attached (hashing included), into
  a cache holding `batch` other sequences; cache_insert_known_prompt: the same given its first 2,000 tokens'
  block hashes (a PD prompt's, from the prefill side), so only the output's pages are hashed.
Median of --iters, ms (perf_counter). Writes bench/results/host_step_costs-<time>.json (or under $OUT).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from libs.engine.cuda_graph import DecodeLayout, fill_decode_inputs
from libs.engine.pages import PageAllocator
from libs.engine.radix_cache import RadixCache
from libs.loadgen.report import write_json
from libs.prefix.hashing import extend_hashes, root_hash

PAGE = 16


def _median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


class _Batch:
    """`batch` rows (page list, position) growing one token a step; with churn, a finish mid-batch and a join."""

    def __init__(self, batch: int, context: int, churn: bool, seed: int = 0) -> None:
        self.rng, self.context, self.churn = random.Random(seed), context, churn
        self.next_page = 0
        self.rows = [self._new() for _ in range(batch)]

    def _new(self) -> tuple[list[int], int]:
        n = self.context // PAGE + 2
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages, self.context

    def step(self) -> tuple[list[int], list[list[int]]]:
        self.rows = [(pages, p + 1) for pages, p in self.rows]
        for pages, p in self.rows:
            if p // PAGE + 1 > len(pages):
                pages.append(self.next_page)  # in place, as the engine's `r.pages += ...`
                self.next_page += 1
        if self.churn:
            del self.rows[self.rng.randrange(len(self.rows))]
            self.rows.append(self._new())
        return [p for _, p in self.rows], [pages for pages, _ in self.rows]


def fill_cost(batch: int, context: int, iters: int, memo: bool, churn: bool) -> float:
    layout = DecodeLayout(batch, context // PAGE + 8 + iters // PAGE)
    buf = np.zeros(layout.size, dtype=np.int32)
    written: list[tuple[Any, int]] | None = [(None, 0)] * batch if memo else None
    rows, tokens = _Batch(batch, context, churn), [0] * batch

    def one() -> None:
        positions, tables = rows.step()
        fill_decode_inputs(buf, layout, tokens, positions, tables, PAGE, 0, written)

    return _median_ms(one, iters)


class _Listener:
    def blocks_stored(self, hashes: list[int]) -> None:
        pass

    def blocks_removed(self, hashes: list[int]) -> None:
        pass


def insert_cost(batch: int, context: int, iters: int, prompt: int = 0) -> float:
    """One finished sequence's insert; with `prompt` > 0 its first `prompt` tokens' block hashes are given,
    as a PD decode worker gets them from the prefill side (KvReady.block_hashes), computed outside the timing."""
    rng = random.Random(1)
    n_pages = context // PAGE + 1
    alloc = PageAllocator((batch + iters + 2) * n_pages)
    cache = RadixCache(alloc, PAGE)
    cache.set_listener(_Listener())
    for _ in range(batch):
        cache.insert([rng.randrange(120_000) for _ in range(context)], alloc.alloc(n_pages))
    made = [
        ([rng.randrange(120_000) for _ in range(context)], alloc.alloc(n_pages)) for _ in range(iters + 1)
    ]
    seqs = iter([(t, p, extend_hashes(root_hash(PAGE), t[:prompt], PAGE) if prompt else []) for t, p in made])

    def one() -> None:
        tokens, pages, known = next(seqs)
        cache.insert(tokens, pages, known)

    return _median_ms(one, iters)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument(
        "--context", type=int, default=2090, help="tokens per row (a 2,000-token prompt + output)"
    )
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--output", default="")
    a = ap.parse_args(argv)
    tokens = [random.Random(2).randrange(120_000) for _ in range(a.context)]
    ms = {
        "fill_full": fill_cost(a.batch, a.context, a.iters, memo=False, churn=False),
        "fill_memo": fill_cost(a.batch, a.context, a.iters, memo=True, churn=False),
        "fill_full_churn": fill_cost(a.batch, a.context, a.iters, memo=False, churn=True),
        "fill_memo_churn": fill_cost(a.batch, a.context, a.iters, memo=True, churn=True),
        "extend_hashes": _median_ms(lambda: extend_hashes(root_hash(PAGE), tokens, PAGE), a.iters),
        "cache_insert": insert_cost(a.batch, a.context, a.iters),
        "cache_insert_known_prompt": insert_cost(a.batch, a.context, a.iters, prompt=a.context - 90),
    }
    rec = {
        "benchmark": "host_step_costs", "batch": a.batch, "context": a.context, "iters": a.iters, "ms": ms,
        "machine": f"{platform.node()} ({os.cpu_count()} cpus)", "load_avg": os.getloadavg(),
        "command": "python -m bench.host_step_costs " + " ".join(sys.argv[1:] if argv is None else argv),
    }  # fmt: skip
    out = (
        Path(a.output)
        if a.output
        else Path(os.environ.get("OUT") or "bench/results")
        / (f"host_step_costs-{time.strftime('%Y%m%dT%H%M%S')}.json")
    )
    write_json(out, rec)
    for k, v in ms.items():
        print(f"{k:>26}: {v:.3f} ms")
    print(f"wrote {out}")
    return rec


if __name__ == "__main__":
    main()
