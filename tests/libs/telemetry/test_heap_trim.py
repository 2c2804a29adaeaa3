"""malloc_trim hands glibc's freed-but-kept heap back: memory freed between live chunks (which glibc keeps,
RSS staying up) leaves RSS once trimmed; a burst a thread freed into its own arena comes back only when the
process has one arena (malloc_arena_max 1)."""

from __future__ import annotations

import subprocess
import sys

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


BURST = """
import ctypes, sys, threading
from libs.telemetry.heap_report import rss_bytes, set_arena_max, trim_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "1":
    assert set_arena_max(1)
def burst():  # an engine thread's forward: one large buffer (glibc raises its thresholds), then many smaller
    big = libc.malloc(20 << 20); libc.memset(big, 1, 20 << 20); libc.free(big)
    chunks = [libc.malloc(64 << 10) for _ in range(512)]  # 32 MiB, under the raised trim threshold
    for c in chunks:
        libc.memset(c, 1, 64 << 10)
    for c in reversed(chunks):
        libc.free(c)
trim_heap()  # the baseline trimmed too: the trim after the burst hands back only the burst's pages
before = rss_bytes()
t = threading.Thread(target=burst)
t.start()
t.join()
trim_heap()
print((rss_bytes() - before) >> 20)
"""


def kept_mib(arena_max: int) -> int:
    """MiB of RSS a thread's freed 32 MiB burst leaves behind after a trim, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", BURST, str(arena_max)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_a_threads_burst_comes_back_with_one_arena_and_stays_with_its_own():
    # glibc's default: the thread's own arena keeps the burst at its top, which malloc_trim does not shrink
    assert kept_mib(0) >= 16  # of the 32 MiB burst (32 alone, 25 beside a process churning memory: kept_mib(0) on the VM)
    # malloc_arena_max 1 (the workers' default on the CPU): the main arena, which the trim hands back
    assert kept_mib(1) <= 4
