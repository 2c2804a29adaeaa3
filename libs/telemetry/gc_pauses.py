"""Python's garbage collector in a serving process: its pauses measured (every collection stops every thread
of the process while it holds the GIL: the engine thread's step included), and the start-up heap frozen."""

# `GcPauses` hooks `gc.callbacks`: each collection's duration goes to the histogram
# `moemesh_gc_pause_seconds{generation}` and to a running total that a step trace reads before and after a
# step. `freeze_startup_heap` collects once and moves every object alive then (the model's modules, the
# tokenizer, compiled kernels' wrappers, warm-up leftovers) into the permanent generation, so later
# collections of the oldest generation do not walk them again: one such walk of a worker's start-up heap costs
# hundreds of milliseconds, and it lands in whichever decode step triggers it. vLLM freezes its engine's
# start-up heap the same way (`gc.freeze()` after start-up).

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GcPauses:
    """Collections' pauses while installed: `total_s` (all generations), `count`, the histogram on `registry`
    when given, and with `keep` each one as (generation, ms) in `seen` (a benchmark's window). Install once
    per process (`install`); `uninstall` ends it."""

    def __init__(self, registry: CollectorRegistry | None = None, keep: bool = False) -> None:
        self.total_s = 0.0
        self.count = 0
        self.seen: list[tuple[int, float]] | None = [] if keep else None
        self._t0 = 0.0
        self._hist = (
            Histogram(
                "moemesh_gc_pause_seconds",
                "Python garbage-collection pauses (all threads stop)",
                ["generation"],
                buckets=BUCKETS,
                registry=registry,
            )
            if registry is not None
            else None
        )

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.total_s += took
        self.count += 1
        generation = info.get("generation", -1)
        if self._hist is not None:
            self._hist.labels(generation=str(generation)).observe(took)
        if self.seen is not None:
            self.seen.append((generation, round(1000 * took, 3)))

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def freeze_startup_heap() -> int:
    """Collect, then freeze what survives (gc.freeze): -> how many objects are now frozen. Call once start-up
    (model load, warm-up) is done; objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
