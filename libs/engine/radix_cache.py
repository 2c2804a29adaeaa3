"""Radix-tree prefix cache over KV pages (SGLang's RadixCache, at page granularity).

Each edge holds a run of whole pages: its token key (a multiple of page_size tokens) and the page ids
whose KV rows hold exactly those tokens at those positions. Only full pages are cached, so a request
that reuses a prefix starts writing at a page boundary into pages of its own and cached pages are never
written again.

Invariants:
- The cache holds one allocator reference per page it stores (taken at insert, dropped at eviction);
  whoever matched a prefix takes its own references too, so a page lives while anyone holds it.
- `lock(node)` pins the path root..node while a request uses it; only unlocked leaves are evicted,
  least recently used first. `evictable_pages` counts pages in unlocked nodes.

Events (prefix-aware routing): with a `CacheListener` set, every node also keeps its pages' block hashes
(libs.prefix) and the listener hears each run of pages that enters the cache (`blocks_stored`) or leaves
it (`blocks_removed`), on the thread that changed the cache. Without one, nothing is hashed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from libs.engine.pages import PageAllocator
from libs.prefix import extend_hashes, root_hash

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: list[int] = field(default_factory=list)  # tokens, len == len(pages) * page_size
    pages: list[int] = field(default_factory=list)
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hashes: list[int] = field(default_factory=list)  # block hash per page, while a listener is set

    def __lt__(self, other: RadixNode) -> bool:
        return self.last_access < other.last_access


@dataclass
class PrefixMatch:
    pages: list[int]  # cached pages covering the first `length` tokens
    length: int  # matched tokens, a multiple of page_size
    node: RadixNode  # deepest matched node: lock it while the pages are in use


class CacheListener(Protocol):
    """Told of every block run entering or leaving the cache (hashes in prefix order)."""

    def blocks_stored(self, hashes: list[int]) -> None: ...

    def blocks_removed(self, hashes: list[int]) -> None: ...


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.root = RadixNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.cached_pages = 0
        self.evictable_pages = 0
        self.listener: CacheListener | None = None

    def set_listener(self, listener: CacheListener | None) -> None:
        """Report cache changes to `listener` from now on; what is cached already is reported as stored."""
        self.listener = listener
        if listener is None:
            return
        stack = [(child, root_hash(self.page_size)) for child in self.root.children.values()]
        while stack:  # parents before children, so every run's parent hash is known
            node, parent = stack.pop()
            node.hashes = extend_hashes(parent, node.key, self.page_size)
            listener.blocks_stored(list(node.hashes))
            stack.extend((c, node.hashes[-1]) for c in node.children.values())

    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _matched_pages(self, key: list[int], tokens: Sequence[int], start: int) -> int:
        """How many whole pages of `key` equal tokens[start:]."""
        ps = self.page_size
        n = min(len(key), len(tokens) - start) // ps
        for i in range(n):
            if key[i * ps : (i + 1) * ps] != list(tokens[start + i * ps : start + (i + 1) * ps]):
                return i
        return n

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached whole-page prefix of `tokens` (read-only apart from LRU time and splits)."""
        full = len(tokens) // self.page_size * self.page_size
        node, pos, pages = self.root, 0, []
        now = next(_clock)
        node.last_access = now
        while pos < full:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._matched_pages(child.key, tokens[:full], pos)
            if n * self.page_size < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return PrefixMatch(pages, pos, node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], hashes: Sequence[int] = ()) -> int:
        """Cache the whole pages of `tokens` (KV in `pages`); returns how many tokens were cached already.

        Where a prefix is already cached the existing pages stay and the caller's duplicates are left to
        the caller; the cache takes references only on the pages it newly stores.

        `hashes`: block hashes already known for the leading pages of `tokens` (a PD prompt's, computed by
        the prefill worker's cache): used for the new pages they cover, where they chain onto the cached
        prefix, instead of hashing those pages again; the rest are computed. (They only name blocks in KV
        events, the routing hints; what matches is always decided on the tokens.)"""
        full = len(tokens) // self.page_size * self.page_size
        if len(pages) < full // self.page_size:
            raise ValueError(f"insert: {len(pages)} pages cannot hold {full} tokens")
        match = self.match_prefix(tokens[:full])
        if match.length < full:
            first = match.length // self.page_size
            new_pages = list(pages[first : full // self.page_size])
            self.allocator.incref(new_pages)
            leaf = RadixNode(list(tokens[match.length : full]), new_pages, match.node)
            leaf.last_access = next(_clock)
            match.node.children[self._page_key(leaf.key, 0)] = leaf
            self.cached_pages += len(new_pages)
            self.evictable_pages += len(new_pages)
            if self.listener is not None:
                parent = match.node.hashes[-1] if match.node.hashes else root_hash(self.page_size)
                leaf.hashes = self._leaf_hashes(parent, leaf.key, first, hashes)
                self.listener.blocks_stored(list(leaf.hashes))
        return match.length

    def _leaf_hashes(self, parent: int, key: list[int], first: int, known: Sequence[int]) -> list[int]:
        """Hashes of a new leaf's pages (pages first.. of the sequence): the known ones when the first of them
        is what this cache computes for that page after `parent` (one digest: same chain, page size and
        tokens), then the rest computed."""
        ps = self.page_size
        reuse = list(known[first : first + len(key) // ps])
        if reuse and extend_hashes(parent, key[:ps], ps)[0] != reuse[0]:
            reuse = []
        if len(reuse) * ps == len(key):
            return reuse
        start = reuse[-1] if reuse else parent
        return reuse + extend_hashes(start, key[len(reuse) * ps :], ps)

    def path_hashes(self, node: RadixNode) -> list[int]:
        """The block hashes of every page from the root down to `node` (a cached prompt's, in order); empty
        without a listener (nothing is hashed then)."""
        runs = []
        while node is not self.root and node is not None:
            if len(node.hashes) != len(node.pages):
                return []
            runs.append(node.hashes)
            node = node.parent  # type: ignore[assignment]
        return [h for run in reversed(runs) for h in run]

    def lock(self, node: RadixNode) -> None:
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise ValueError("radix cache: unlock without a matching lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, LRU first, if possible; returns pages freed."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            leaf = heapq.heappop(heap)
            freed += self._remove_leaf(leaf)
            parent = leaf.parent
            if (
                parent is not None
                and parent is not self.root
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, parent)
        return freed

    def reset(self) -> int:
        """Evict everything not locked; returns pages freed."""
        return self.evict(self.cached_pages)

    def _remove_leaf(self, leaf: RadixNode) -> int:
        assert leaf.parent is not None
        del leaf.parent.children[self._page_key(leaf.key, 0)]
        self.cached_pages -= len(leaf.pages)
        self.evictable_pages -= len(leaf.pages)
        if self.listener is not None:
            self.listener.blocks_removed(list(leaf.hashes))
        return self.allocator.free(leaf.pages)

    def _split(self, child: RadixNode, n_pages: int) -> RadixNode:
        """Cut `child` after its first n_pages pages; returns the new upper half (which keeps the lock)."""
        assert child.parent is not None and 0 < n_pages < len(child.pages)
        cut = n_pages * self.page_size
        upper = RadixNode(child.key[:cut], child.pages[:n_pages], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hashes, child.hashes = child.hashes[:n_pages], child.hashes[n_pages:]
        child.parent.children[self._page_key(upper.key, 0)] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[n_pages:], upper
        upper.children[self._page_key(child.key, 0)] = child
        return upper

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
