"""Page allocator over the KVPool's pages: a free list plus a reference count per page. Every holder (a
request's page table, a radix-cache node, a PD reservation) holds one reference and drops it when done; a
page is free again at count zero."""

# So the prefix cache and several requests share a page without tracking each other. Cached pages are never
# written again (only full pages are cached; new tokens go to a request's own pages): no copy-on-write.

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than asked for (after the caller's evictions)."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator needs num_pages >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with one reference (the caller's)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPagesError(
                f"out of KV pages: asked for {n}, {len(self._free)} free of {self.num_pages}"
            )
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Take one more reference on pages someone already holds."""
        pages = list(pages)
        for p in pages:
            self._check(p)
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free; only a held page can gain a reference")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> int:
        """Drop one reference per page; returns how many pages went back to the free list."""
        pages = list(pages)
        for p in pages:
            self._check(p)
        released = 0
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} freed more often than it was referenced")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                released += 1
        return released

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} outside the pool (0..{self.num_pages - 1})")
