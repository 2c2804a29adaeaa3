"""Is a sampled series flat? Pure judgements for long runs (bench.soak): a slope fitted within process
lifetimes (a restart resets memory, so each lifetime gets its own intercept), the median of the last
third of a run against the first (robust to the spikes faults cause), and for a series a periodic purge
cuts back (a sawtooth), what each purge leaves."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Point = tuple[float, float]  # (seconds, value)


def pooled_slope(segments: Sequence[Sequence[Point]]) -> float | None:
    """Least-squares slope (value per second) shared by all segments, each with its own intercept;
    None when no segment has two distinct times."""
    sxy = sxx = 0.0
    for seg in segments:
        if len(seg) < 2:
            continue
        mx = sum(t for t, _ in seg) / len(seg)
        my = sum(v for _, v in seg) / len(seg)
        sxy += sum((t - mx) * (v - my) for t, v in seg)
        sxx += sum((t - mx) ** 2 for t, _ in seg)
    return sxy / sxx if sxx > 0 else None


def thirds(points: Sequence[Point]) -> tuple[float, float] | None:
    """(median of the first third, median of the last third) by time; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    pts = sorted(points)
    t0, t1 = pts[0][0], pts[-1][0]
    span = (t1 - t0) / 3
    first = [v for t, v in pts if t <= t0 + span]
    last = [v for t, v in pts if t >= t1 - span]
    return statistics.median(first), statistics.median(last)


@dataclass(frozen=True)
class Judgement:
    name: str
    flat: bool
    why: str

    def as_dict(self) -> dict:
        return {"series": self.name, "flat": self.flat, "why": self.why}


def judge_slope(name: str, segments: Sequence[Sequence[Point]], per_hour_tol: float) -> Judgement:
    """Flat when the pooled slope, projected over one hour, grows by at most `per_hour_tol`."""
    s = pooled_slope(segments)
    if s is None:
        return Judgement(name, False, "too few samples to fit a slope")
    growth = s * 3600
    return Judgement(name, growth <= per_hour_tol, f"{growth:+.3g}/h (tolerance {per_hour_tol:.3g}/h)")


def judge_thirds(name: str, points: Sequence[Point], rel_tol: float, abs_tol: float) -> Judgement:
    """Flat when the last third's median is at most the first third's x (1 + rel_tol) + abs_tol."""
    m = thirds(points)
    if m is None:
        return Judgement(name, False, "too few samples")
    first, last = m
    limit = first * (1 + rel_tol) + abs_tol
    return Judgement(name, last <= limit, f"median {first:.3g} -> {last:.3g} (limit {limit:.3g})")


def purge_troughs(points: Sequence[Point]) -> list[Point]:
    """The samples right after a purge, in a series that only grows between purges: each one lower than
    the sample before it."""
    pts = sorted(points)
    return [b for a, b in zip(pts, pts[1:], strict=False) if b[1] < a[1]]


def judge_purged(
    name: str, points: Sequence[Point], period_s: float, rel_tol: float, abs_tol: float
) -> Judgement:
    """A series that grows between purges which cut it back every `period_s` or so (a JetStream bucket's
    messages: delete markers pile up until they are old enough to purge). Its medians rise and fall with
    the purge clock, so thirds would judge the phase; what a purge leaves is what must stay put. Flat when
    the last trough is at most the first x (1 + rel_tol) + abs_tol, and purges keep coming: no stretch
    from the first purge to the end of the run longer than 2.5 periods without one. With fewer than two
    purges seen it is judged by thirds (a series that grows with no purge in sight is not flat)."""
    pts = sorted(points)
    troughs = purge_troughs(pts)
    if len(troughs) < 2:
        j = judge_thirds(name, pts, rel_tol, abs_tol)
        return Judgement(name, j.flat, f"{len(troughs)} purge(s) seen, judged by thirds: {j.why}")
    times = [t for t, _ in troughs] + [pts[-1][0]]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    first, last = troughs[0][1], troughs[-1][1]
    limit = first * (1 + rel_tol) + abs_tol
    why = (
        f"after {len(troughs)} purges {first:.3g} -> {last:.3g} (limit {limit:.3g}); at most {gap:.0f} s "
        f"without a purge (limit {2.5 * period_s:.0f} s)"
    )
    return Judgement(name, last <= limit and gap <= 2.5 * period_s, why)
