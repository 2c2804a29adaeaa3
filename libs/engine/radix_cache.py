"""Radix-tree prefix cache over whole KV pages (SGLang's RadixCache), optionally tiered to a host pool.
The cache holds one allocator reference per page it stores (a matcher takes its own); `lock` pins a path, and only
unlocked nodes are evicted, least recently used first. Listeners hear page runs enter, leave and change tier."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from libs.engine.host_pool import HostKVPool
from libs.engine.pages import OutOfPagesError, PageAllocator
from libs.prefix import extend_hashes, root_hash

_clock = itertools.count()


class Tier(enum.IntEnum):
    """Where a cached page lives (the same numbers as proto.messages.KvTier)."""

    DEVICE = 0
    HOST = 1
    STORE = 2


@dataclass(eq=False)
class RadixNode:
    key: list[int] = field(default_factory=list)  # tokens, len == len(pages) * page_size
    pages: list[int] = field(default_factory=list)  # device page ids, or host page ids on the host tier
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hashes: list[int] = field(default_factory=list)  # block hash per page, while hashing
    tier: Tier = Tier.DEVICE  # device nodes top the tree: a device node's parent is on the device

    def __lt__(self, other: RadixNode) -> bool:
        return self.last_access < other.last_access


@dataclass
class PrefixMatch:
    pages: list[int]  # device pages covering the first tokens of the match (all of it once loaded)
    length: int  # matched tokens on any tier, a multiple of page_size
    node: RadixNode  # deepest matched node: lock it while the pages are in use
    host_nodes: list[RadixNode] = field(default_factory=list)  # host-tier nodes of the path, top-down


class CacheListener(Protocol):
    """Told of every block run entering or leaving the cache (hashes in prefix order)."""

    def blocks_stored(self, hashes: list[int]) -> None: ...

    def blocks_removed(self, hashes: list[int]) -> None: ...


class TierListener(CacheListener, Protocol):
    """A listener that also hears blocks change tier (DEVICE or HOST), or reach the shared store (STORE)."""

    def blocks_moved(self, hashes: list[int], tier: int) -> None: ...


@dataclass
class TierCounters:
    """Pages moved between tiers and host-tier hits, since start (the worker exports them)."""

    offloaded_pages: int = 0  # device -> host
    loaded_pages: int = 0  # host -> device
    host_dropped_pages: int = 0  # host pages dropped to make room
    host_hit_pages: int = 0  # pages of matches served from the host tier


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, host: HostKVPool | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.host = host
        self.root = RadixNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.cached_pages = 0  # device pages
        self.evictable_pages = 0  # device pages in unlocked nodes
        self.host_cached_pages = 0
        self.counters = TierCounters()
        self.listener: CacheListener | None = None  # called on the thread that changed the cache
        self.hashing = False  # hash new pages even without a listener (the store tier names them so)
        # hears (hashes, device pages) of every new run (the store tier's publish)
        self.on_stored: Callable[[list[int], list[int]], None] | None = None

    def set_listener(self, listener: CacheListener | None) -> None:
        """Report cache changes to `listener` from now on; what is cached already is reported as stored
        (host-tier runs then as moved to HOST, when the listener hears tiers)."""
        self.listener = listener
        if listener is None:
            return
        stack = [(child, root_hash(self.page_size)) for child in self.root.children.values()]
        while stack:  # parents before children, so every run's parent hash is known
            node, parent = stack.pop()
            if len(node.hashes) != len(node.pages):
                node.hashes = extend_hashes(parent, node.key, self.page_size)
            listener.blocks_stored(list(node.hashes))
            if node.tier is Tier.HOST:
                self._moved(node)
            stack.extend((c, node.hashes[-1]) for c in node.children.values())

    @property
    def _hashed(self) -> bool:
        return self.listener is not None or self.hashing

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
        """The longest cached whole-page prefix of `tokens` on any tier (read-only apart from LRU time and
        splits); its host-tier part is in `host_nodes`, not in `pages`."""
        full = len(tokens) // self.page_size * self.page_size
        node, pos, pages, host_nodes = self.root, 0, [], []
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
            if child.tier is Tier.HOST:
                host_nodes.append(child)
            else:
                pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return PrefixMatch(pages, pos, node, host_nodes)

    def load_host(self, match: PrefixMatch) -> PrefixMatch:
        """Copy a locked match's host-tier nodes back to device pages (allocating, evicting others); the
        result's pages cover its whole length. Where the device runs out the match ends early: the lock
        moves to its new last node."""
        if not match.host_nodes:
            return match
        assert self.host is not None
        pages, last = list(match.pages), match.host_nodes[0].parent
        for node in match.host_nodes:
            partial = False
            try:
                dev = self._alloc_device(len(node.pages))
            except OutOfPagesError:
                room = self.allocator.num_free  # the evictions above freed what could be freed
                if room == 0:
                    break
                node, partial = self._split(node, room), True  # load what fits; the rest stays
                dev = self.allocator.alloc(room)
            self.host.free_after(self.host.to_device(node.pages, dev), node.pages)
            n = len(dev)
            node.pages, node.tier = dev, Tier.DEVICE
            self.cached_pages += n
            self.host_cached_pages -= n
            self.counters.loaded_pages += n
            self.counters.host_hit_pages += n
            self._moved(node)
            pages += dev
            last = node
            if partial:
                break
        assert last is not None
        if last is not match.node:
            self.lock(last)
            self.unlock(match.node)
        return PrefixMatch(pages, len(pages) * self.page_size, last)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], hashes: Sequence[int] = ()) -> int:
        """Cache the whole pages of `tokens` (KV in `pages`); returns how many tokens were cached already.
        Cached device pages stay (duplicates remain the caller's), cached host nodes take the caller's pages; the
        cache increfs only pages it newly stores. `hashes`: known block hashes of leading pages (KV event names)."""
        full = len(tokens) // self.page_size * self.page_size
        if len(pages) < full // self.page_size:
            raise ValueError(f"insert: {len(pages)} pages cannot hold {full} tokens")
        # only whole pages are cached: a request reusing a prefix writes into pages of its own, never cached ones
        match = self.match_prefix(tokens[:full])
        for node in match.host_nodes:
            first = self._depth_pages(node)
            self._to_device(node, list(pages[first : first + len(node.pages)]))
        if match.length < full:
            first = match.length // self.page_size
            new_pages = list(pages[first : full // self.page_size])
            self.allocator.incref(new_pages)
            leaf = RadixNode(list(tokens[match.length : full]), new_pages, match.node)
            leaf.last_access = next(_clock)
            match.node.children[self._page_key(leaf.key, 0)] = leaf
            self.cached_pages += len(new_pages)
            self.evictable_pages += len(new_pages)
            if self._hashed:
                parent = match.node.hashes[-1] if match.node.hashes else root_hash(self.page_size)
                leaf.hashes = self._leaf_hashes(parent, leaf.key, first, hashes)
                if self.listener is not None:
                    self.listener.blocks_stored(list(leaf.hashes))
                if self.on_stored is not None:
                    self.on_stored(list(leaf.hashes), list(new_pages))
        return match.length

    def _depth_pages(self, node: RadixNode) -> int:
        """Pages on the path above `node` (its first page's index in a matching sequence)."""
        n, p = 0, node.parent
        while p is not None and p is not self.root:
            n += len(p.pages)
            p = p.parent
        return n

    def _to_device(self, node: RadixNode, dev: list[int]) -> None:
        """A host node takes device pages that hold its tokens' KV (the caller's reference stays its own)."""
        assert self.host is not None and node.tier is Tier.HOST
        self.allocator.incref(dev)
        self.host.free(node.pages)
        n = len(dev)
        node.pages, node.tier = dev, Tier.DEVICE
        self.cached_pages += n
        self.host_cached_pages -= n
        if node.lock_ref == 0:
            self.evictable_pages += n
        self._moved(node)

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
        when nothing is hashed."""
        runs = []
        while node is not self.root and node is not None:
            if len(node.hashes) != len(node.pages):
                return []
            runs.append(node.hashes)
            node = node.parent  # type: ignore[assignment]
        return [h for run in reversed(runs) for h in run]

    def insert_host(
        self, parent: RadixNode, key: list[int], host_pages: list[int], hashes: list[int]
    ) -> None:
        """Cache pages already in the host pool (fetched from the shared store) as a new host-tier child of
        `parent`, whose path ends where `key` starts; the cache takes over the caller's host references."""
        assert self.host is not None and len(key) == len(host_pages) * self.page_size
        leaf = RadixNode(list(key), list(host_pages), parent, tier=Tier.HOST, hashes=list(hashes))
        leaf.last_access = next(_clock)
        parent.children[self._page_key(key, 0)] = leaf
        self.host_cached_pages += len(host_pages)
        if self.listener is not None:
            self.listener.blocks_stored(list(hashes))
            self._moved(leaf)

    def lock(self, node: RadixNode) -> None:
        """Pin the path root..node while a request uses it (locked nodes are never evicted)."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0 and node.tier is Tier.DEVICE:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise ValueError("radix cache: unlock without a matching lock")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.tier is Tier.DEVICE:
                self.evictable_pages += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    # --- eviction ---
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device pages from unlocked nodes, LRU first, if possible (to the host
        tier where it has room, else dropped); returns device pages freed."""
        return self._evict(num_pages, offload=self.host is not None)

    def _evict(self, num_pages: int, offload: bool) -> int:
        heap = [n for n in self._nodes() if self._device_frontier(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            node = heapq.heappop(heap)
            parent = node.parent
            freed += self._offload(node) if offload else self._drop(node)
            if parent is not None and parent is not self.root and self._device_frontier(parent):
                heapq.heappush(heap, parent)
        return freed

    def _device_frontier(self, n: RadixNode) -> bool:
        """An unlocked device node with no device children: the next to leave the device."""
        return (
            n.tier is Tier.DEVICE
            and n.lock_ref == 0
            and not any(c.tier is Tier.DEVICE for c in n.children.values())
        )

    def _offload(self, node: RadixNode) -> int:
        """Move a device-frontier node to the host tier (dropping it, with its host subtree, where no host
        page is to be had); returns device pages freed."""
        assert self.host is not None
        n = len(node.pages)
        if self.host.num_free < n:
            self._evict_host(n - self.host.num_free)
        if self.host.num_free < n:
            return self._drop(node)
        host_pages = self.host.alloc(n)
        self.host.to_host(node.pages, host_pages)
        freed = self.allocator.free(node.pages)
        node.pages, node.tier = host_pages, Tier.HOST
        self.cached_pages -= n
        self.evictable_pages -= n
        self.host_cached_pages += n
        self.counters.offloaded_pages += n
        self._moved(node)
        return freed

    def _evict_host(self, num_pages: int) -> None:
        """Drop unlocked host leaves, LRU first, until `num_pages` host pages are free or none is left."""
        heap = [n for n in self._nodes() if n.tier is Tier.HOST and not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        dropped = 0
        while heap and dropped < num_pages:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            dropped += len(leaf.pages)
            self._drop(leaf)
            if (
                parent is not None
                and parent.tier is Tier.HOST
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, parent)

    def _drop(self, node: RadixNode) -> int:
        """Remove an unlocked node and its (host-tier, unlocked) subtree; returns device pages freed."""
        assert node.parent is not None
        freed = 0
        for child in list(node.children.values()):
            freed += self._drop(child)
        del node.parent.children[self._page_key(node.key, 0)]
        n = len(node.pages)
        if node.tier is Tier.HOST:
            assert self.host is not None
            self.host_cached_pages -= n
            self.counters.host_dropped_pages += n
            self.host.free(node.pages)
        else:
            self.cached_pages -= n
            self.evictable_pages -= n
            freed += self.allocator.free(node.pages)
        if self.listener is not None:
            self.listener.blocks_removed(list(node.hashes))
        return freed

    def reset(self) -> int:
        """Drop everything not locked, on every tier; returns device pages freed."""
        freed = self._evict(self.cached_pages, offload=False)
        for child in list(self.root.children.values()):
            freed += self._drop_unlocked(child)
        return freed

    def _drop_unlocked(self, node: RadixNode) -> int:
        if node.lock_ref:
            return sum(self._drop_unlocked(c) for c in list(node.children.values()))
        return self._drop(node)

    def _alloc_device(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(n)

    def _moved(self, node: RadixNode) -> None:
        moved = getattr(self.listener, "blocks_moved", None)
        if moved is not None and node.hashes:
            moved(list(node.hashes), int(node.tier))

    def _split(self, child: RadixNode, n_pages: int) -> RadixNode:
        """Cut `child` after its first n_pages pages; returns the new upper half (which keeps the lock)."""
        assert child.parent is not None and 0 < n_pages < len(child.pages)
        cut = n_pages * self.page_size
        upper = RadixNode(child.key[:cut], child.pages[:n_pages], child.parent, tier=child.tier)
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
