"""PNG plots of benchmark results with matplotlib (Figure objects, no pyplot state, no display)."""

# - latency CDFs: TTFT, TPOT, ITL and E2E, one line per run (e.g. per concurrency of a sweep);
# - sweep: output throughput against concurrency, median TPOT and median E2E latency;
# - slow-down: the decode batch and the token rate over time, with the release marked.

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from libs.loadgen.stats import RequestRecord


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    v = np.sort(np.asarray(values_ms))
    ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label)


def _save(fig: Figure, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    return p


def latency_cdfs(
    runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: str | Path, title: str = ""
) -> Path:
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    panels = {
        "TTFT": lambda rs: [r.ttft * 1e3 for r in rs],
        "TPOT": lambda rs: [t * 1e3 for r in rs if (t := r.tpot) is not None],
        "ITL": lambda rs: [x * 1e3 for r in rs for x in r.itls],
        "E2E latency": lambda rs: [r.e2e * 1e3 for r in rs],
    }
    for ax, (name, values) in zip(axes.flat, panels.items(), strict=True):
        for label, records in runs:
            _cdf(ax, values([r for r in records if r.ok]), label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def sweep(points: Sequence[tuple[int, dict]], path: str | Path, title: str = "") -> Path:
    """points: (concurrency, summary) per run of a sweep."""
    conc = [c for c, _ in points]
    out = [s["output_throughput"] for _, s in points]
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    a, b, c = fig.subplots(1, 3)
    a.plot(conc, out, "o-")
    a.set_xlabel("max concurrency")
    a.set_ylabel("output throughput (tok/s)")
    a.set_xscale("log", base=2)
    for ax, key, name in ((b, "tpot_ms", "median TPOT (ms)"), (c, "e2e_ms", "median E2E latency (ms)")):
        x = [s[key]["median"] for _, s in points]
        ax.plot(x, out, "o-")
        for xi, yi, ci in zip(x, out, conc, strict=True):
            ax.annotate(f"c={ci}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(name)
        ax.set_ylabel("output throughput (tok/s)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    a.set_title("throughput vs concurrency")
    b.set_title("throughput vs per-token latency")
    c.set_title("throughput vs request latency")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def token_rate(records: Sequence[RequestRecord], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Tokens/s over time from chunk arrivals, in bins of bin_s (bin centres, rates)."""
    times = np.asarray([t for r in records for t in r.chunk_times])
    counts = np.asarray([n for r in records for n in r.chunk_tokens], dtype=np.float64)
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, times.max() + bin_s, bin_s)
    hist, _ = np.histogram(times, bins=edges, weights=counts)
    return (edges[:-1] + edges[1:]) / 2, hist / bin_s


def slowdown(runs: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """runs: dicts with `label`, `records`, `batch_trace` [(t, decode running, prefilling)], `release_s`."""
    fig = Figure(figsize=(12, 4.5 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs, strict=True):
        recs = run["records"]
        end = max((r.end for r in recs), default=1.0)
        x, y = token_rate(recs, bin_s=max(end / 80, 0.02))
        ax.plot(x, y, color="tab:blue", label="output tokens/s (client)")
        ax.set_xlabel("time since the first request (s)")
        ax.set_ylabel("tokens/s", color="tab:blue")
        twin = ax.twinx()
        trace = run["batch_trace"]
        times = [t for t, _, _ in trace]
        twin.step(
            times, [b for _, b, _ in trace], where="post", color="tab:orange", label="decode batch (running)"
        )
        twin.step(
            times, [p for _, _, p in trace], where="post", color="tab:green", label="prompts in prefill"
        )
        twin.set_ylabel("requests")
        if run.get("release_s") is not None:
            ax.axvline(run["release_s"], color="tab:red", linestyle="--", label="slow-down released")
        ax.set_title(run["label"])
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)
