"""An opt-in timeline of a decode worker's steps (setting `step_trace`: JSON lines): hand-off to the engine
thread, engine step, hand-back, publishing. `StepTrace` buffers rows and appends them every `every` steps;
`full_batch` is the pure analysis of a finished trace. Times are perf_counter seconds (CLOCK_MONOTONIC)."""

# CLOCK_MONOTONIC is time.monotonic()'s clock on Linux, one for every process of the machine, so traces of
# several processes line up. The rows of an unfinished buffer are lost when the process is killed.

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

# device_wait: seconds of the engine step blocked on the device (Engine.last_device_wait_s; -1 when unknown)
# gc: seconds of Python garbage-collection pauses during the engine step (any thread's: all stop)
FIELDS = (
    "submitted",
    "engine_in",
    "engine_out",
    "seen",
    "published",
    "outputs",
    "tokens",
    "sleep_ms",
    "device_wait",
    "gc",
)


class StepTrace:
    def __init__(self, path: str | Path, every: int = 256) -> None:
        self.path, self.every = Path(path), every
        self.rows: list[tuple[float, ...]] = []
        self._enc = msgspec.json.Encoder()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")  # one trace per worker start

    @classmethod
    def for_worker(cls, path: str | Path, instance_id: str) -> StepTrace:
        """One file per worker beside the path the setting names: <stem>-<instance id><suffix>."""
        p = Path(path)
        return cls(p.with_name(f"{p.stem}-{instance_id}{p.suffix}"))

    def add(self, *row: float) -> None:
        if len(row) != len(FIELDS):
            raise ValueError(f"a step row has {len(FIELDS)} fields {FIELDS}, got {len(row)}")
        self.rows.append(row)
        if len(self.rows) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            with self.path.open("ab") as f:
                f.write(
                    b"".join(self._enc.encode(dict(zip(FIELDS, r, strict=True))) + b"\n" for r in self.rows)
                )
            self.rows.clear()


def load(path: str | Path) -> list[dict[str, float]]:
    return [msgspec.json.decode(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


def _ms(xs: Sequence[float]) -> dict[str, float] | None:
    if not xs:
        return None
    s = sorted(xs)
    return {
        "median": 1000 * statistics.median(s), "p90": 1000 * s[int(0.9 * (len(s) - 1))], "max": 1000 * s[-1],
        "mean": 1000 * statistics.fmean(s),
    }  # fmt: skip


def _after_release(rows: Sequence[dict[str, float]]) -> Sequence[dict[str, float]]:
    """The steps after the last slow-down sleep (the seed's release); all of them when none slept."""
    slept = [i for i, r in enumerate(rows) if r["sleep_ms"]]
    return rows[slept[-1] + 1 :] if slept else rows


def _wait(row: dict[str, float]) -> float | None:
    """The step's device wait in seconds; None where the engine or the trace does not say."""
    w = row.get("device_wait", -1.0)
    return w if w >= 0 else None


def series(rows: Sequence[dict[str, float]], limit: int = 800) -> dict[str, list]:
    """The steps after the last slow-down sleep (at most `limit`), one list per quantity, ms to 0.01 (None
    for an unknown device wait): to see which steps were slow and what they carried, beside `full_batch`."""
    rows = list(_after_release(rows))[:limit]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 2)

    return {
        "outputs": [int(r["outputs"]) for r in rows],
        "interval_ms": [ms(b["published"] - a["published"]) for a, b in zip(rows, rows[1:], strict=False)],
        "engine_ms": [ms(r["engine_out"] - r["engine_in"]) for r in rows],
        "device_wait_ms": [ms(_wait(r)) for r in rows],
        "idle_ms": [ms(b["engine_in"] - a["engine_out"]) for a, b in zip(rows, rows[1:], strict=False)],
        "gc_ms": [ms(r.get("gc", 0.0)) for r in rows],
    }


def full_batch(rows: Sequence[dict[str, float]], min_outputs: int) -> dict[str, Any]:
    """After the last slow-down sleep (the seed's release; the whole trace when none slept), the longest run
    of consecutive steps that each gave at least `min_outputs` outputs: the worker's own tokens/s there (first
    step's publish to last step's publish) and where each step's time went. None-valued when no run of two."""
    best: list[dict[str, float]] = []
    run: list[dict[str, float]] = []
    for r in _after_release(rows):
        if r["outputs"] >= min_outputs:
            run.append(r)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    if len(best) < 2:
        return {"steps": len(best), "tokens_per_s": None}
    span = best[-1]["published"] - best[0]["published"]
    return {
        "steps": len(best),
        "tokens_per_s": sum(r["tokens"] for r in best[1:]) / span if span > 0 else None,
        "step_interval_ms": _ms(
            [b["published"] - a["published"] for a, b in zip(best, best[1:], strict=False)]
        ),
        "engine_step_ms": _ms([r["engine_out"] - r["engine_in"] for r in best]),
        # of which blocked on the device: near 0 means the host's work per step is what sets the pace
        "device_wait_ms": _ms([w for r in best if (w := _wait(r)) is not None]),
        "to_engine_ms": _ms([r["engine_in"] - r["submitted"] for r in best]),  # loop -> engine thread
        "to_loop_ms": _ms([r["seen"] - r["engine_out"] for r in best]),  # engine thread -> loop
        "publish_ms": _ms([r["published"] - r["seen"] for r in best]),
        "engine_idle_ms": _ms(
            [b["engine_in"] - a["engine_out"] for a, b in zip(best, best[1:], strict=False)]
        ),
        "gc_ms": _ms([r.get("gc", 0.0) for r in best]),  # collections' pauses inside the engine steps
    }
