"""Where a service's memory goes (`heap_report_s`): RSS beside pymalloc's arenas and blocks in use and glibc's
heap in use and freed but kept, or with `heap_report_frames` tracemalloc's lines grown most; and `trim_heap`,
glibc's freed-but-kept heap handed back to the OS (`malloc_trim_s`); `set_arena_max`, glibc's arenas bounded
(`malloc_arena_max`)."""

# Each line gives the change since the service was ready. A leak grows what is in use with RSS; an allocator
# keeping memory after a burst (arenas pinned by a few live objects, glibc's free lists) grows RSS while what
# is in use stays flat: trim_heap returns glibc's part of that.
# Without tracing a report costs a walk of pymalloc's pools (milliseconds). With tracing every allocation
# is slower and a snapshot walks every traced block holding the GIL (longer for a worker's heap): a
# debugging aid (bench.soak --heap-report turns it on for one service), not for serving.

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import tempfile
import tracemalloc
from dataclasses import dataclass

log = logging.getLogger("moemesh.heap")

MIB = 1 << 20
_IGNORED = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if hasattr(lib, "mallinfo2"):  # glibc >= 2.33 only; musl and macOS have none
        lib.mallinfo2.restype = _MallInfo2
    if hasattr(lib, "malloc_trim"):  # glibc only
        lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if hasattr(lib, "mallopt"):
        lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return lib


_LIBC = _libc()


def malloc_bytes() -> tuple[int, int] | None:
    """glibc's heap: (bytes in use, bytes freed but kept by malloc), mmapped chunks counted as in use;
    None without glibc's mallinfo2."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    mi = _LIBC.mallinfo2()
    return mi.uordblks + mi.hblkhd, mi.fordblks


def can_trim() -> bool:
    """Whether `trim_heap` can do anything here (glibc's malloc_trim)."""
    return _LIBC is not None and hasattr(_LIBC, "malloc_trim")


M_ARENA_MAX = -8  # mallopt's parameter (glibc malloc.h)


def set_arena_max(n: int) -> bool:
    """At most `n` glibc malloc arenas from here on (mallopt M_ARENA_MAX, what MALLOC_ARENA_MAX sets at exec):
    with 1 every thread allocates from the main arena, whose free memory `trim_heap` can hand back; a thread's
    own arena keeps a freed burst at its top (glibc trims those only on a free past its threshold, which
    grows up to 64 MiB). Call it before the threads start; False where glibc is not there."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt") or n <= 0:
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, n))


def trim_heap() -> bool:
    """glibc's freed-but-kept heap handed back to the OS (`malloc_trim(0)`, as Dask's workers do; the
    `malloc_trim_s` setting); ctypes releases the GIL. True when memory went back."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None and can_trim() else False


def pymalloc_bytes() -> tuple[int, int] | None:
    """Python's small-object allocator: (bytes of its arenas, bytes of blocks in use in them), read from
    `sys._debugmallocstats()` (it writes to the C stderr, caught here in a temporary file); None where it
    says nothing (another allocator, or PYTHONMALLOC=malloc)."""
    debug = getattr(sys, "_debugmallocstats", None)
    if debug is None:
        return None
    with tempfile.TemporaryFile() as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            debug()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    nums: dict[str, int] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.startswith("# "):
            nums[key[2:].strip()] = int(value.strip().replace(",", "") or 0)
    arenas, used = nums.get("arenas allocated current"), nums.get("bytes in allocated blocks")
    return None if arenas is None or used is None else (arenas << 20, used)  # 1 MiB arenas (3.10+)


def rss_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class HeapState:
    rss: int
    traced: int  # -1: not tracing
    traced_peak: int
    pymalloc_arenas: int  # -1: unknown (tracemalloc on, or another allocator)
    pymalloc_used: int
    malloc_used: int  # -1: unknown (no mallinfo2)
    malloc_free: int

    @classmethod
    def now(cls) -> HeapState:
        traced, peak = tracemalloc.get_traced_memory() if tracemalloc.is_tracing() else (-1, -1)
        arenas, in_blocks = pymalloc_bytes() or (-1, -1)
        used, free = malloc_bytes() or (-1, -1)
        return cls(rss_bytes(), traced, peak, arenas, in_blocks, used, free)

    def describe(self, base: HeapState) -> str:
        """One line: each number with its change since `base`."""

        def mib(now: int, then: int) -> str:
            return f"{now / MIB:.1f} MiB ({(now - then) / MIB:+.1f})"

        parts = [f"rss {mib(self.rss, base.rss)}"]
        if self.traced >= 0 and base.traced >= 0:
            parts.append(f"traced {mib(self.traced, base.traced)}, peak {self.traced_peak / MIB:.1f} MiB")
        if self.pymalloc_arenas >= 0 and base.pymalloc_arenas >= 0:
            parts.append(
                f"pymalloc arenas {mib(self.pymalloc_arenas, base.pymalloc_arenas)} holding "
                f"{mib(self.pymalloc_used, base.pymalloc_used)} in use"
            )
        if self.malloc_used >= 0:
            parts.append(
                f"malloc in use {mib(self.malloc_used, base.malloc_used)}, freed but kept "
                f"{mib(self.malloc_free, base.malloc_free)}"
            )
        return ", ".join(parts)


class HeapReport:
    """`start()` early, `mark_ready()` once set up (the baseline), then `report()` every interval: returns
    what it logged. frames 0: the allocators' totals only (pymalloc's arenas and blocks in use, glibc's heap:
    no cost between reports); frames > 0: tracemalloc on from `start()`, keeping that many frames per block
    (pymalloc's own counters are then hidden behind its hooks), and the report adds the traced total, the
    `top` source lines grown most since the baseline and the 3 call paths grown most."""

    def __init__(self, frames: int = 0, top: int = 10) -> None:
        self.frames, self.top = frames, top
        self._base: tracemalloc.Snapshot | None = None
        self._base_state: HeapState | None = None

    def start(self) -> None:
        if self.frames > 0 and not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)

    def _snapshot(self) -> tracemalloc.Snapshot | None:
        if not tracemalloc.is_tracing():
            return None
        return tracemalloc.take_snapshot().filter_traces(_IGNORED)

    def mark_ready(self) -> None:
        self._base = self._snapshot()
        self._base_state = HeapState.now()

    def report(self) -> str:
        if self._base_state is None:
            self.mark_ready()
        assert self._base_state is not None
        snap, now = self._snapshot(), HeapState.now()
        lines = [f"heap since ready: {now.describe(self._base_state)}"]
        if snap is not None and self._base is not None:
            for d in [d for d in snap.compare_to(self._base, "lineno") if d.size_diff > 0][: self.top]:
                lines.append(
                    f"  {d.size_diff / 1024:+.1f} KiB {d.count_diff:+d} blocks (now {d.size / 1024:.1f} KiB): "
                    f"{d.traceback[0].filename}:{d.traceback[0].lineno}"
                )
            for d in [d for d in snap.compare_to(self._base, "traceback") if d.size_diff > 0][:3]:
                where = " < ".join(f"{f.filename}:{f.lineno}" for f in d.traceback)  # innermost first
                lines.append(f"  by caller {d.size_diff / 1024:+.1f} KiB {d.count_diff:+d} blocks: {where}")
        text = "\n".join(lines)
        log.info("%s", text)
        return text
