"""Shared helpers for the GPU benchmarks: timing, environment record, JSON results."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def environment() -> dict:
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpus": torch.cuda.device_count(),
    }


def cpu_environment(load_before: float) -> dict:
    """The CPU benchmarks' machine record; on a shared machine the 1-minute load average before and after
    the run says how quiet it was."""
    import platform

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn (events, L2 flushed between runs) via triton's do_bench."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(graph: torch.cuda.CUDAGraph, iters: int = 10) -> list[float]:
    """Per-replay milliseconds of a captured graph (each replay timed with its own events)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def write_results(name: str, records: list[dict]) -> Path:
    """bench/results/<name>-<utc time>.json, or under $OUT when set (the device machine's return folder)."""
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(records, indent=1))
    return path
