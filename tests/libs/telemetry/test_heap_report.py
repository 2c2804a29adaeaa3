"""The heap report: without tracing, pymalloc's arenas and blocks in use and glibc's heap beside RSS; with
tracing, the traced total and the source line whose memory grew since the baseline."""

from __future__ import annotations

import tracemalloc

import pytest

from libs.telemetry.heap_report import HeapReport, HeapState, malloc_bytes, pymalloc_bytes


def _grow(n: int) -> list[bytes]:
    return [bytes(1000) + bytes([i % 256]) for i in range(n)]  # the line the traced report must name


def test_traced_report_names_the_line_that_grew() -> None:
    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc is on already (its baseline would not be this test's)")
    report = HeapReport(frames=4, top=5)
    report.start()
    try:
        report.mark_ready()
        kept = _grow(2000)  # ~2 MiB
        head, *lines = report.report().splitlines()
        assert head.startswith("heap since ready: rss ")
        traced_growth = float(head.split("traced ")[1].split("(")[1].split(")")[0])
        assert traced_growth >= 1.8  # MiB
        assert "pymalloc" not in head  # hidden behind tracemalloc's hooks
        assert "test_heap_report.py:14" in lines[0]
        assert any("by caller" in x and "test_heap_report.py:14" in x for x in lines)
        assert len(kept) == 2000
    finally:
        tracemalloc.stop()


def test_untraced_report_shows_the_allocators() -> None:
    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc is on: pymalloc's counters are hidden")
    report = HeapReport()
    report.start()
    assert not tracemalloc.is_tracing()
    report.mark_ready()
    kept = [object() for _ in range(50_000)]  # small objects: pymalloc blocks
    head = report.report()
    assert "traced" not in head and "\n" not in head
    arenas, used = pymalloc_bytes() or (0, 0)
    assert arenas >= used > 0
    growth = float(head.split("holding ")[1].split("(")[1].split(")")[0])
    assert growth >= 0.7  # 50k objects of 16 bytes
    assert len(kept) == 50_000


def test_state_and_malloc_counters() -> None:
    s = HeapState.now()
    assert s.rss > 0
    m = malloc_bytes()
    if m is not None:  # glibc
        assert m[0] > 0 and m[1] >= 0
