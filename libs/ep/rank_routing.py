"""Which rank of an EP group gets a new request (pure): the rank caching most of its prefix unless it is
busier than the least busy by more than `slack`, else the least busy. `RankBlocks` merges the ranks' cache
events into one stream: a block is stored when the first rank caches it, removed when the last drops it."""

# Each rank has its own KV pool and prefix cache (DP attention), so a prefix is reused only on the rank that
# cached it. Ties: more free pages, then the lower rank. The kv-broker's index knows workers, not ranks.

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing libs.engine would load the whole engine
    from libs.engine.radix_cache import CacheListener


def pick_rank(busy: Sequence[int], free: Sequence[int], matched: Sequence[int], slack: int) -> int:
    """busy: live requests per rank; free: free + evictable pages; matched: cached prefix pages."""
    least = min(busy)
    candidates = [r for r in range(len(busy)) if busy[r] <= least + slack]
    return max(candidates, key=lambda r: (matched[r], -busy[r], free[r], -r))


class RankBlocks:
    def __init__(self, ranks: int) -> None:
        self.blocks: list[set[int]] = [set() for _ in range(ranks)]
        self.refs: dict[int, int] = {}  # block -> ranks holding it
        self.listener: CacheListener | None = None

    def apply(self, rank: int, events: Sequence[tuple[bool, list[int]]]) -> None:
        """One rank's cache events, in order: (stored?, block hashes)."""
        held = self.blocks[rank]
        for stored, hashes in events:
            changed = []
            for h in hashes:
                if stored and h not in held:
                    held.add(h)
                    self.refs[h] = self.refs.get(h, 0) + 1
                    changed += [h] if self.refs[h] == 1 else []
                elif not stored and h in held:
                    held.discard(h)
                    self.refs[h] -= 1
                    if self.refs[h] == 0:
                        del self.refs[h]
                        changed.append(h)
            if changed and self.listener is not None:
                (self.listener.blocks_stored if stored else self.listener.blocks_removed)(changed)

    def set_listener(self, listener: CacheListener | None) -> None:
        """From now on; what some rank caches already is reported as stored at once."""
        self.listener = listener
        if listener is not None and self.refs:
            listener.blocks_stored(list(self.refs))

    def matched(self, hashes: Sequence[int]) -> list[int]:
        """Per rank: how many of `hashes` (a prompt's blocks, in order) it holds as an unbroken prefix."""
        out = []
        for held in self.blocks:
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out.append(n)
        return out
