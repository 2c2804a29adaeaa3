"""A CacheListener for tests (libs.engine's prefix-cache events, libs.ep's merged rank events): keeps the
events in order."""

from __future__ import annotations


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []

    def blocks_stored(self, hashes: list[int]) -> None:
        self.events.append(("stored", hashes))

    def blocks_removed(self, hashes: list[int]) -> None:
        self.events.append(("removed", hashes))

    def held(self) -> set[int]:
        """The hashes stored and not removed since."""
        out: set[int] = set()
        for kind, hs in self.events:
            out = out | set(hs) if kind == "stored" else out - set(hs)
        return out
