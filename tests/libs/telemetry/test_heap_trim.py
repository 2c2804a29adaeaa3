"""malloc_trim hands glibc's freed-but-kept heap back: memory freed between live chunks (which glibc keeps,
RSS staying up) leaves RSS once trimmed."""

from __future__ import annotations

import pytest

from libs.telemetry.heap_report import can_trim, rss_bytes, trim_heap

pytestmark = pytest.mark.skipif(not can_trim(), reason="malloc_trim is glibc's")


def test_memory_freed_between_live_chunks_leaves_rss_once_trimmed():
    trim_heap()
    chunks = [bytearray(8192) for _ in range(40_000)]  # ~330 MB of glibc heap (under its mmap threshold)
    for c in chunks:
        c[::4096] = b"\x01" * len(c[::4096])  # touched: resident
    keep = chunks[::64]  # a live chunk every 512 KB pins the heap: glibc cannot shrink it from the top
    del chunks
    before = rss_bytes()
    assert trim_heap()
    after = rss_bytes()
    assert before - after > 200 << 20, (before >> 20, after >> 20)
    assert len(keep) == 625
