"""Kernel choices of the FP8 GEMMs (fp8_gemm.py) as a pure function of (shape key, device name, Triton version,
tuning tables), so every serving process picks the same tiles and sum order: `choose` returns a table's entry,
else the caller's fixed default. Candidates are timed only inside `tuning(table_dir)`, `moemesh tune`'s step."""

# Same sum order everywhere is why temperature 0 gives one answer whichever worker serves it. In tuning, the
# candidates are timed from CUDA-graph replays (`graph_time`, the one function that touches the GPU; CPU tests
# fake it), each first checked against the first working candidate's output, and the fastest written to `table_dir`. Keys hold a bucket of M (`m_bucket`), never M: prefill's
# token count changes almost every step; powers of two keep their own bucket (the captured decode sizes),
# rows past M_BUCKET_MAX share one. Tables: one JSON per device name and Triton version,
# {"tables": {table: {key: candidate}}}, read once per process from libs/kernels/tuning/ and the user's
# MOEMESH_TUNING_DIR (default ~/.cache/moemesh/tuning; empty: none), the user's entries winning.

from __future__ import annotations

import fcntl
import functools
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

M_BUCKET_MAX = 4096
SHIPPED_DIR = Path(__file__).parent / "tuning"
CACHE_ENV = "MOEMESH_TUNING_DIR"

C = TypeVar("C")

TIMINGS: dict[tuple, dict[str, float]] = {}  # what was measured per key (ms), for tune records
REJECTED: dict[tuple, str] = {}  # (key, candidate) -> why it could not run
DEFAULTED: dict[tuple[str, tuple], str] = {}  # (table, key) -> the default taken: no table entry for it
# wall time of this process's sweeps (a sweep nested in another's timing counted once, in the outer one)
# and candidates timed
SPENT = {"seconds": 0.0, "timings": 0}
_DEPTH = [0]  # sweeps in progress on this thread's stack
# table -> key text -> chosen candidate's text, from the files (None: not read yet in this process)
_STORED: dict[str, dict[str, str]] | None = None


@dataclass(frozen=True)
class _Tuning:
    table_dir: Path  # where tuned choices are written
    retune: bool  # time keys the tables already answer, too


_TUNING: _Tuning | None = None  # set only inside `tuning()`


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
    # allocator gave `out` from (a just-freed temporary). The second keeps the timing's work off whatever
    # runs next.
    torch.cuda.synchronize()
    ms = float(triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median"))
    torch.cuda.synchronize()
    return ms


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of got against ref (float32, no inf), entries NaN in both counting as equal
    (what neither wrote); inf where only one is NaN, where got holds an inf, or where ref is all zeros and got
    is not."""
    g = got.float()
    nan_g, nan_r = torch.isnan(g), torch.isnan(ref)
    if bool((nan_g ^ nan_r).any()):
        return float("inf")
    diff = torch.where(nan_r, 0.0, g - ref).norm().item()
    scale = torch.where(nan_r, 0.0, ref).norm().item()
    if not math.isfinite(diff):
        return float("inf")
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def device_tag() -> str:
    """The table file's name: device and Triton version (a config's speed, and its text, belong to both)."""
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9.]+", "_", f"{name}-triton-{triton.__version__}")


def cache_dir() -> Path | None:
    """The user's folder of tuning tables, None when MOEMESH_TUNING_DIR is set empty."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "moemesh" / "tuning"
    return Path(value) if value else None


def table_path(folder: Path) -> Path:
    return folder / f"{device_tag()}.json"


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        tables = json.loads(path.read_text())["tables"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as err:  # a damaged file takes defaults, never fails
        logging.getLogger("moemesh.kernels").warning("ignoring tuning table %s: %s", path, err)
        return {}
    return {str(t): {str(k): str(v) for k, v in keys.items()} for t, keys in tables.items()}


def stored() -> dict[str, dict[str, str]]:
    """The choices of the shipped and user tables for this device (and, while tuning, of the table being
    written), read once per process."""
    global _STORED
    if _STORED is None:
        _STORED = {}
        folders = [SHIPPED_DIR, cache_dir(), _TUNING.table_dir if _TUNING else None]
        for folder in (f for f in folders if f is not None):
            for table, keys in _read(table_path(folder)).items():
                _STORED.setdefault(table, {}).update(keys)
    return _STORED


def _key_text(key: tuple) -> str:
    return ",".join(str(part) for part in key)


@contextmanager
def tuning(table_dir: str | Path, retune: bool = False) -> Iterator[Path]:
    """The offline tune step: inside it, a key no table answers (every key, with `retune`) is timed and its
    fastest candidate written to `table_dir`'s table at once (a run cut short keeps what it tuned).
    -> the table file's path."""
    global _TUNING, _STORED
    if _TUNING is not None:
        raise RuntimeError("tuning() does not nest")
    _TUNING, _STORED = _Tuning(Path(table_dir), retune), None
    try:
        yield table_path(Path(table_dir))
    finally:
        _TUNING, _STORED = None, None


def tuning_active() -> bool:
    return _TUNING is not None


def remember(table: str, key: tuple, choice: str) -> None:
    """Add one choice to this process's view and to the table being tuned, merged with what other processes
    wrote there meanwhile (an exclusive lock around read-merge-replace). Only inside `tuning()`."""
    if _TUNING is None:
        raise RuntimeError("tuning tables are written only by the tune step (gemm_tuning.tuning)")
    stored().setdefault(table, {})[_key_text(key)] = choice
    folder = _TUNING.table_dir
    folder.mkdir(parents=True, exist_ok=True)
    path = table_path(folder)
    with open(folder / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tables = _read(path)
        tables.setdefault(table, {})[_key_text(key)] = choice
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"device": device_tag(), "tables": tables}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def choose(
    cache: dict[tuple, C], key: tuple, candidates: Sequence[C], run: Callable[[C], object], table: str,
    default: C, output: torch.Tensor | None = None,
) -> C:  # fmt: skip
    """cache[key]: the table's choice when it is one of `candidates`, else `default` (the same in every
    process); inside `tuning()`, a key without a usable entry is timed instead (`fastest`, checking each
    candidate's `output` against the first's). Callers reach this first outside CUDA-graph capture (warm-up),
    never inside it."""
    if key not in cache:
        texts = [str(c) for c in candidates]
        known = stored().get(table, {}).get(_key_text(key))
        if _TUNING is not None and (_TUNING.retune or known not in texts):
            cache[key] = fastest(key, candidates, run, table, output)
        elif known in texts:
            cache[key] = candidates[texts.index(known)]
        else:
            cache[key] = default
            DEFAULTED[(table, key)] = str(default)
    return cache[key]


CHECK_TOLERANCE = 1e-2  # relative error of a candidate's output against the first candidate's


def fastest(key: tuple, candidates: Sequence[C], run: Callable[[C], object], table: str,
            output: torch.Tensor | None = None) -> C:  # fmt: skip
    """Each candidate timed with `run(candidate)`; the fastest written to the table being tuned. A candidate
    that fails (compile or resource limits for this shape), or whose `output` (the buffer `run` writes, set
    back to what it held before each candidate's check run and after the sweep) differs from the first
    working candidate's by more than CHECK_TOLERANCE, is skipped and why kept in REJECTED: a wrong but fast
    kernel is never chosen. When all fail, the first is returned and nothing is written. Only inside
    `tuning()`."""
    if _TUNING is None:
        raise RuntimeError("kernel candidates are timed only in the tune step (gemm_tuning.tuning)")
    texts = [str(c) for c in candidates]
    times: list[float] = []
    reference: torch.Tensor | None = None
    reference_name = ""
    original = output.clone() if output is not None else None  # what the caller's buffer held, put back after
    checking = output is not None
    t0 = time.perf_counter()
    _DEPTH[0] += 1
    try:
        for cand in candidates:
            try:
                if checking and output is not None and original is not None:
                    output.copy_(original)  # what a candidate leaves alone compares equal
                    run(cand)
                    if reference is None:
                        reference, reference_name = output.to(torch.float32, copy=True), str(cand)
                        checking = not bool(torch.isinf(reference).any())  # else nothing to hold the others to
                    elif (err := _rel_err(output, reference)) > CHECK_TOLERANCE:
                        raise ValueError(f"output differs from candidate {reference_name}'s by {err:.1e} (relative)")
                times.append(graph_time(functools.partial(run, cand)))
            except Exception as err:  # noqa: BLE001 - recorded; the others still compete
                REJECTED[(key, str(cand))] = f"{type(err).__name__}: {str(err)[:200]}"
                times.append(float("inf"))
    finally:
        _DEPTH[0] -= 1
        if output is not None and original is not None:
            output.copy_(original)
    SPENT["seconds"] += 0.0 if _DEPTH[0] else time.perf_counter() - t0
    SPENT["timings"] += len(candidates)
    best = min(range(len(candidates)), key=times.__getitem__)
    TIMINGS[key] = dict(zip(texts, times, strict=True))
    if times[best] != float("inf"):
        remember(table, key, texts[best])
    return candidates[best]
