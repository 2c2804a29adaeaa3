"""Per-request timings and the serving metrics computed from them (pure arithmetic, no I/O)."""

# Times are seconds on one monotonic clock shared by every request of a run. Definitions (SGLang's
# bench_serving, vLLM's benchmark_serving):
# - TTFT: first content chunk's arrival minus the send time.
# - E2E: the stream's end minus the send time.
# - TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
# - ITL: gaps between consecutive content chunks of one request (a chunk may carry several tokens).
# - Throughput: completed requests, input tokens and output tokens per second of wall time.
# - Achieved concurrency: the sum of request durations over the wall time (mean requests in flight).
# Distributions report mean, median, p90 and p99 (numpy's linear interpolation), in milliseconds.

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request. `chunk_tokens[i]` is how many tokens chunk i carried
    (exact when the server names them, e.g. through logprobs; 1 per content chunk otherwise)."""

    index: int
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's usage count, else the dataset's
    completion_tokens: int = 0  # the server's usage count, else the sum of chunk_tokens
    ok: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_json(self) -> dict:
        """As a dict, times rounded to the microsecond (the clock's useful precision here)."""
        d = asdict(self)
        for key in ("start", "end"):
            d[key] = round(d[key], 6)
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return d


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | int]:
    """mean / median / p90 / p99 / min / max in milliseconds, and the sample count (zeros when empty)."""
    v = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if v.size == 0:
        return {"count": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "min": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(v, PERCENTILES)
    return {
        "count": int(v.size), "mean": float(v.mean()), "median": float(p50), "p90": float(p90),
        "p99": float(p99), "min": float(v.min()), "max": float(v.max()),
    }  # fmt: skip


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """The benchmark's headline numbers over the successful requests of one run of `duration_s`."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s!r}")
    ok = [r for r in records if r.ok]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.completion_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": inputs / duration_s,
        "output_throughput": outputs / duration_s,
        "total_token_throughput": (inputs + outputs) / duration_s,
        "concurrency": sum(r.e2e for r in ok) / duration_s,
        "ttft_ms": distribution_ms(r.ttft for r in ok),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms(x for r in ok for x in r.itls),
        "e2e_ms": distribution_ms(r.e2e for r in ok),
    }


def decode_rate(records: Sequence[RequestRecord], t_from: float, t_to: float) -> dict:
    """Aggregate decode tokens/s over the window (t_from, t_to]: the tokens of each request's chunks after its
    first chunk in the window, summed over requests, divided by the time from the mean of those first
    chunks to t_to (a delay before the first step, such as a slow-down sleep, stays out)."""
    tokens, starts, gaps = 0, [], []
    for r in records:
        inside = [(t, n) for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True) if t_from < t <= t_to]
        if not inside:
            continue
        starts.append(inside[0][0])
        tokens += sum(n for _, n in inside[1:])
        gaps += [b[0] - a[0] for a, b in zip(inside, inside[1:], strict=False)]
    span = t_to - sum(starts) / len(starts) if starts else 0.0
    return {
        "window_s": max(t_to - t_from, 0.0),
        "requests": len(starts),
        "tokens": tokens,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "itl_ms": distribution_ms(gaps),
    }


def aggregate_rate(records: Sequence[RequestRecord], t_from: float, t_to: float) -> float:
    """Tokens/s of all chunks arriving in (t_from, t_to], whatever the batch was meanwhile."""
    if t_to <= t_from:
        return 0.0
    tokens = sum(
        n for r in records for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True) if t_from < t <= t_to
    )
    return tokens / (t_to - t_from)
