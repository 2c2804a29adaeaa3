"""First-use tuning of the FP8 GEMMs (libs/kernels/fp8_gemm.py): each candidate (a Triton config, a Gluon
config, a split-K factor) timed from CUDA-graph replays and the fastest kept, once per process and key.

Keys hold a bucket of M (`m_bucket`), never M itself: in prefill M is a batch's token count, different
almost every step, and an exact-M key re-ran the whole sweep (every candidate compiled and timed, for every
GEMM shape) on each new count, minutes of tuning spread over a server's first requests. Powers of two keep
their own bucket, so each captured decode batch size is still tuned for itself; rows past M_BUCKET_MAX
share one bucket (the tile choice stops changing long before; SGLang and vLLM tune such M likewise).

`graph_time` is the only function that touches the GPU: tests on the CPU replace it with a fake.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

M_BUCKET_MAX = 4096

C = TypeVar("C")

TIMINGS: dict[tuple, dict[str, float]] = {}  # what was measured per key (ms), for benchmarks to record
REJECTED: dict[tuple, str] = {}  # (key, candidate) -> why it could not run


def m_bucket(m: int) -> int:
    """The tuning bucket of a GEMM with m rows: the next power of two (m itself when it is one), at most
    M_BUCKET_MAX."""
    if m < 1:
        raise ValueError(f"a GEMM has at least one row, got {m}")
    return min(1 << (m - 1).bit_length(), M_BUCKET_MAX)


def graph_time(fn: Callable[[], object]) -> float:
    """Median ms of fn replayed from a CUDA graph: the kernels' own time, as a captured decode step sees
    it (eager timing of these microsecond kernels measures the Python launch path instead)."""
    import triton.testing

    # do_bench_cudagraph runs the candidates on a stream of its own, unordered with this one: without the
    # first sync their writes to `out` can land while kernels queued here still read what the caching
    # allocator gave `out` from (a just-freed temporary), corrupting them; seen on the H200 as NaN tiles in
    # a float32 matmul queued just before a first-use FP8 GEMM. The second keeps the timing's work off
    # whatever runs next.
    torch.cuda.synchronize()
    ms = float(triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median"))
    torch.cuda.synchronize()
    return ms


def fastest(cache: dict[tuple, C], key: tuple, candidates: Sequence[C], run: Callable[[C], object]) -> C:
    """cache[key], timing `run(candidate)` for every candidate on the first call of a key. A candidate that
    fails (compile or resource limits for this shape) is skipped and its error kept in REJECTED. Callers
    reach this first outside CUDA-graph capture (warm-up), never inside it."""
    if key not in cache:
        times: list[float] = []
        for cand in candidates:
            try:
                times.append(graph_time(functools.partial(run, cand)))
            except Exception as err:  # noqa: BLE001 - recorded; the others still compete
                REJECTED[(key, str(cand))] = f"{type(err).__name__}: {str(err)[:200]}"
                times.append(float("inf"))
        best = min(range(len(candidates)), key=times.__getitem__)
        cache[key] = candidates[best]
        TIMINGS[key] = {str(c): t for c, t in zip(candidates, times, strict=True)}
    return cache[key]
