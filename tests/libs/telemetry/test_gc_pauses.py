"""Garbage-collection pauses measured into a histogram and a running total; the start-up heap frozen."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry

from libs.telemetry.gc_pauses import GcPauses, freeze_startup_heap


def test_collections_are_timed_into_the_total_and_the_histogram() -> None:
    reg = CollectorRegistry()
    pauses = GcPauses(reg).install()
    try:
        pauses.install()  # twice: still one callback
        assert gc.callbacks.count(pauses) == 1
        for _ in range(3):
            gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses not in gc.callbacks
    assert pauses.count >= 3 and pauses.total_s > 0 and pauses.seen is None
    assert reg.get_sample_value("moemesh_gc_pause_seconds_count", {"generation": "2"}) >= 3
    before = pauses.count
    gc.collect()
    assert pauses.count == before  # uninstalled: no longer counts


def test_freezing_moves_the_live_heap_out_of_the_collections() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    kept = [Node() for _ in range(1000)]
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() and frozen >= 1000
        assert all(not any(n is o for o in gc.get_objects(2)) for n in kept[:3])  # not in generation 2 now
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_kept_collections_name_their_generation() -> None:
    """keep=True (a benchmark's window): each collection as (generation, ms), adding up to the total."""
    pauses = GcPauses(keep=True).install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.seen is not None and [g for g, _ in pauses.seen][-2:] == [0, 2]
    assert sum(ms for _, ms in pauses.seen) == pytest.approx(1000 * pauses.total_s, abs=0.01)
