"""First-use tuning of the FP8 GEMMs (libs/kernels/fp8_gemm.py): each candidate (a Triton config, a Gluon
config, a split-K factor) timed from CUDA-graph replays and the fastest kept per key, and remembered across
processes in a tuning table (as SGLang and vLLM ship per-device config files for their Triton GEMMs).

Keys hold a bucket of M (`m_bucket`), never M itself: in prefill M is a batch's token count, different
almost every step, and an exact-M key re-ran the whole sweep (every candidate compiled and timed, for every
GEMM shape) on each new count, minutes of tuning spread over a server's first requests. Powers of two keep
their own bucket, so each captured decode batch size is still tuned for itself; rows past M_BUCKET_MAX
share one bucket (the tile choice stops changing long before; SGLang and vLLM tune such M likewise).

Tables: one JSON file per device name and Triton version, {table: {key: chosen candidate}}, read from the
project's shipped folder (libs/kernels/tuning/, measured with `python -m bench.tune_gemm`) and from the user
cache (MOEMESH_TUNING_DIR, default ~/.cache/moemesh/tuning; empty turns it off), the cache winning. A choice
tuned here is added to the cache file at once (merged under a lock: the prefill and decode workers of one
GPU tune side by side), so a restart, or the other worker, compiles and times nothing for it. On the H200 a
cold mesh spent ~490 s warming up with both workers tuning at once.

`graph_time` is the only function that touches the GPU: tests on the CPU replace it with a fake.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

M_BUCKET_MAX = 4096
SHIPPED_DIR = Path(__file__).parent / "tuning"
CACHE_ENV = "MOEMESH_TUNING_DIR"

C = TypeVar("C")

TIMINGS: dict[tuple, dict[str, float]] = {}  # what was measured per key (ms), for benchmarks to record
REJECTED: dict[tuple, str] = {}  # (key, candidate) -> why it could not run
# wall time of this process's sweeps (compiles included; a sweep nested in another's timing, as the Triton
# tile sweep inside the kernel choice's, counted once, in the outer one) and candidates timed
SPENT = {"seconds": 0.0, "timings": 0}
_DEPTH = [0]  # sweeps in progress on this thread's stack
# table -> key text -> chosen candidate's text, from the files (None: not read yet in this process)
_STORED: dict[str, dict[str, str]] | None = None


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


def device_tag() -> str:
    """The table file's name: device and Triton version (a config's speed, and its text, belong to both)."""
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9.]+", "_", f"{name}-triton-{triton.__version__}")


def cache_dir() -> Path | None:
    """The user cache folder of tuning tables, None when MOEMESH_TUNING_DIR is set empty."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "moemesh" / "tuning"
    return Path(value) if value else None


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        tables = json.loads(path.read_text())["tables"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as err:  # a damaged file tunes again, never fails a step
        import logging

        logging.getLogger("moemesh.kernels").warning("ignoring tuning table %s: %s", path, err)
        return {}
    return {str(t): {str(k): str(v) for k, v in keys.items()} for t, keys in tables.items()}


def stored() -> dict[str, dict[str, str]]:
    """The choices of the shipped and cached tables for this device (read once per process)."""
    global _STORED
    if _STORED is None:
        _STORED = {}
        folders = [SHIPPED_DIR, cache_dir()]
        for folder in (f for f in folders if f is not None):
            for table, keys in _read(folder / f"{device_tag()}.json").items():
                _STORED.setdefault(table, {}).update(keys)
    return _STORED


def _key_text(key: tuple) -> str:
    return ",".join(str(part) for part in key)


def _lookup(table: str, key: tuple) -> str | None:
    """The stored choice for a key; on a miss the cache file is read again first, since another process (the
    other worker of this GPU) may have tuned the key since this one read it. Only misses read, and each is
    followed by a sweep of seconds."""
    text = _key_text(key)
    hit = stored().get(table, {}).get(text)
    folder = cache_dir()
    if hit is None and folder is not None:
        hit = _read(folder / f"{device_tag()}.json").get(table, {}).get(text)
        if hit is not None:
            stored().setdefault(table, {})[text] = hit
    return hit


def remember(table: str, key: tuple, choice: str) -> None:
    """Add one choice to this process's view and to the cache file, merged with what other processes wrote
    there meanwhile (an exclusive lock around read-merge-replace)."""
    stored().setdefault(table, {})[_key_text(key)] = choice
    folder = cache_dir()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{device_tag()}.json"
    with open(folder / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tables = _read(path)
        tables.setdefault(table, {})[_key_text(key)] = choice
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"device": device_tag(), "tables": tables}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def fastest(
    cache: dict[tuple, C], key: tuple, candidates: Sequence[C], run: Callable[[C], object], table: str
) -> C:
    """cache[key]: a table's stored choice when it is one of `candidates`, else each candidate timed with
    `run(candidate)` on the first call of a key and the fastest remembered. A candidate that fails (compile or
    resource limits for this shape) is skipped and its error kept in REJECTED. Callers reach this first
    outside CUDA-graph capture (warm-up), never inside it."""
    if key not in cache:
        texts = [str(c) for c in candidates]
        known = _lookup(table, key)
        if known in texts:
            cache[key] = candidates[texts.index(known)]
            return cache[key]
        times: list[float] = []
        t0 = time.perf_counter()
        _DEPTH[0] += 1
        try:
            for cand in candidates:
                try:
                    times.append(graph_time(functools.partial(run, cand)))
                except Exception as err:  # noqa: BLE001 - recorded; the others still compete
                    REJECTED[(key, str(cand))] = f"{type(err).__name__}: {str(err)[:200]}"
                    times.append(float("inf"))
        finally:
            _DEPTH[0] -= 1
        SPENT["seconds"] += 0.0 if _DEPTH[0] else time.perf_counter() - t0
        SPENT["timings"] += len(candidates)
        best = min(range(len(candidates)), key=times.__getitem__)
        cache[key] = candidates[best]
        TIMINGS[key] = dict(zip(texts, times, strict=True))
        if times[best] != float("inf"):
            remember(table, key, texts[best])
    return cache[key]
