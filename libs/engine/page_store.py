"""A shared store of KV pages keyed by name (`PageStore`, the store tier's backend) and an in-process one (tests).
Only the store tier's thread calls it, one call at a time; `connect` until it succeeds, never after. Other calls
may raise or fail (the client recovers by itself); pages never change once put, so re-putting a name succeeds."""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence


class PageStore(ABC):
    @abstractmethod
    def connect(self) -> None:
        """Join the store (may block; raises when it cannot)."""

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Host memory pages are read from and written into (the host KV pool)."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each name is in the store."""

    @abstractmethod
    def get_into(self, names: Sequence[str], ptrs: Sequence[int], size: int) -> list[bool]:
        """Copy each named page (`size` bytes) to its pointer; False where it is missing or failed."""

    @abstractmethod
    def put_from(self, names: Sequence[str], ptrs: Sequence[int], size: int) -> list[bool]:
        """Store `size` bytes at each pointer under its name; False where it failed."""

    def close(self) -> None:  # noqa: B027 - optional
        """Leave the store."""


class InProcessPageStore(PageStore):
    """A dict shared by every engine of one process given the same instance; `down` makes it fail."""

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.down = False
        self.connects = 0
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("in-process page store is down")

    def connect(self) -> None:
        self._check()
        self.connects += 1

    def register(self, ptr: int, nbytes: int) -> None:
        self._check()

    def exists(self, names: Sequence[str]) -> list[bool]:
        self._check()
        with self._lock:
            return [n in self.pages for n in names]

    def get_into(self, names: Sequence[str], ptrs: Sequence[int], size: int) -> list[bool]:
        self._check()
        out = []
        for name, ptr in zip(names, ptrs, strict=True):
            with self._lock:
                data = self.pages.get(name)
            if data is None or len(data) != size:
                out.append(False)
                continue
            ctypes.memmove(ptr, data, size)
            out.append(True)
        return out

    def put_from(self, names: Sequence[str], ptrs: Sequence[int], size: int) -> list[bool]:
        self._check()
        for name, ptr in zip(names, ptrs, strict=True):
            data = ctypes.string_at(ptr, size)
            with self._lock:
                self.pages.setdefault(name, data)
        return [True] * len(names)
