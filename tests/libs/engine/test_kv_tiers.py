"""The host tier under the radix cache: evicted pages go to host memory and come back with their rows,
every device and host page accounted for under random operations, and the engine's greedy tokens equal
with the tier on and off through a multi-turn conversation whose pages are offloaded and loaded back."""

from __future__ import annotations

import random

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.host_pool import HostKVPool
from libs.engine.kv_pool import KVPool
from libs.engine.pages import PageAllocator
from libs.engine.radix_cache import RadixCache, RadixNode, Tier
from libs.engine.tiny import write_tiny_model
from libs.prefix import block_hashes
from tests.libs.cache_recorder import Recorder

PS, LAYERS, ROW = 4, 2, 3


class TierRecorder(Recorder):
    def blocks_moved(self, hashes: list[int], tier: int) -> None:
        self.events.append((f"moved{tier}", hashes))


def _tiered(device_pages: int, host_pages: int) -> tuple[KVPool, PageAllocator, HostKVPool, RadixCache]:
    pool = KVPool(LAYERS, device_pages, PS, ROW)
    alloc, host = PageAllocator(device_pages), HostKVPool(pool, host_pages)
    return pool, alloc, host, RadixCache(alloc, PS, host)


def _value(tokens: list[int], page: int) -> float:
    """What the rows of page `page` of `tokens` hold in these tests (a function of the whole prefix)."""
    return float(hash(tuple(tokens[: (page + 1) * PS])) % 100_003)


def _store(pool: KVPool, alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> None:
    """Compute `tokens` (write their pages' rows) and cache them, as a finished request does."""
    n = len(tokens) // PS
    if alloc.num_free < n:
        cache.evict(n - alloc.num_free)
    pages = alloc.alloc(n)
    view = pool.buffer.view(LAYERS, pool.num_pages, PS, ROW)
    for i, p in enumerate(pages):
        view[:, p] = _value(tokens, i)
    cache.insert(tokens, pages)
    alloc.free(pages)


def _take(cache: RadixCache, alloc: PageAllocator, tokens: list[int]):
    """Match, lock, load the host part and reference the pages, as an admitted request does."""
    m = cache.match_prefix(tokens)
    cache.lock(m.node)
    m = cache.load_host(m)
    alloc.incref(m.pages)
    return m


def _rows_ok(pool: KVPool, tokens: list[int], pages: list[int]) -> bool:
    view = pool.buffer.view(LAYERS, pool.num_pages, PS, ROW)
    return all(bool((view[:, p] == _value(tokens, i)).all()) for i, p in enumerate(pages))


def _check(cache: RadixCache, alloc: PageAllocator, host: HostKVPool, held: int = 0) -> None:
    nodes = cache._nodes()
    dev = [p for n in nodes if n.tier is Tier.DEVICE for p in n.pages]
    hst = [p for n in nodes if n.tier is Tier.HOST for p in n.pages]
    assert len(dev) == len(set(dev)) and len(hst) == len(set(hst))
    assert cache.cached_pages == len(dev) and cache.host_cached_pages == len(hst)
    assert cache.evictable_pages == sum(
        len(n.pages) for n in nodes if n.tier is Tier.DEVICE and n.lock_ref == 0
    )
    assert host.num_used == len(hst)
    assert alloc.num_used == len(dev) + held
    for n in nodes:  # device nodes form the top of the tree
        if n.tier is Tier.DEVICE:
            assert n.parent is cache.root or (n.parent is not None and n.parent.tier is Tier.DEVICE)


def test_an_evicted_page_goes_to_host_and_comes_back_with_its_rows() -> None:
    pool, alloc, host, cache = _tiered(8, 8)
    rec = TierRecorder()
    cache.set_listener(rec)
    a = list(range(1, 13))  # 3 pages
    _store(pool, alloc, cache, a)
    rec.events.clear()
    assert cache.evict(2) >= 2
    assert cache.host_cached_pages == 3 and cache.cached_pages == 0 and alloc.num_free == 8
    assert rec.events == [("moved1", block_hashes(a, PS))]
    _check(cache, alloc, host)
    pool.buffer.zero_()  # the device copy is gone for good
    m = cache.match_prefix(a + [99])
    assert m.length == 12 and m.pages == [] and len(m.host_nodes) == 1
    cache.lock(m.node)
    m = cache.load_host(m)
    alloc.incref(m.pages)
    assert m.length == 12 and _rows_ok(pool, a, m.pages)
    assert rec.events[-1] == ("moved0", block_hashes(a, PS))
    assert cache.counters.offloaded_pages == 3 and cache.counters.loaded_pages == 3
    _check(cache, alloc, host, held=0)
    cache.unlock(m.node)
    alloc.free(m.pages)
    cache.reset()
    assert alloc.num_free == 8 and host.num_free == 8


def test_a_full_host_pool_drops_its_least_recent_leaves_and_says_so() -> None:
    pool, alloc, host, cache = _tiered(4, 4)
    rec = TierRecorder()
    cache.set_listener(rec)
    a, b, c = [1] * 8, [2] * 8, [3] * 8  # two pages each
    for seq in (a, b, c, [4] * 8):  # the device holds two: a, then b, go to the host, which is full
        _store(pool, alloc, cache, seq)
    _store(pool, alloc, cache, [5] * 8)  # c to the host, which drops a, its oldest
    assert ("removed", block_hashes(a, PS)) in rec.events
    assert cache.match_prefix(a).length == 0 and cache.match_prefix(b).length == 8
    assert cache.counters.host_dropped_pages == 2
    _check(cache, alloc, host)
    m = _take(cache, alloc, b)
    assert _rows_ok(pool, b, m.pages)


def test_a_host_node_under_an_insert_takes_the_inserting_requests_pages() -> None:
    pool, alloc, host, cache = _tiered(6, 6)
    a = list(range(1, 9))
    _store(pool, alloc, cache, a)
    cache.evict(2)
    assert cache.host_cached_pages == 2
    _store(pool, alloc, cache, a + list(range(20, 24)))  # recomputed a, then one page more
    assert cache.host_cached_pages == 0 and cache.cached_pages == 3 and host.num_free == 6
    _check(cache, alloc, host)
    m = _take(cache, alloc, a + list(range(20, 25)))
    assert m.length == 12 and _rows_ok(pool, a + list(range(20, 24)), m.pages)


def test_a_load_that_finds_no_device_page_ends_the_match_early() -> None:
    pool, alloc, host, cache = _tiered(3, 6)
    a = list(range(1, 13))
    _store(pool, alloc, cache, a)
    cache.evict(3)
    held = alloc.alloc(2)  # a request holds two of the three device pages
    m = cache.match_prefix(a)
    cache.lock(m.node)
    m = cache.load_host(m)
    assert m.length == 4 and len(m.pages) == 1  # one page could be loaded, the rest stays on the host
    alloc.incref(m.pages)
    _check(cache, alloc, host, held=2)
    cache.unlock(m.node)
    alloc.free(m.pages + held)
    cache.reset()
    assert alloc.num_free == 3 and host.num_free == 6


def test_random_operations_keep_every_page_accounted_and_every_row_right() -> None:
    rng = random.Random(7)
    pool, alloc, host, cache = _tiered(24, 16)
    users: list[tuple[RadixNode, list[int]]] = []

    def seq() -> list[int]:  # shared prefixes: a small alphabet, pages of one repeated token
        return [t for _ in range(rng.randint(1, 6)) for t in [rng.randint(1, 3)] * PS]

    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            tokens = seq()
            if len(tokens) // PS <= alloc.num_free + cache.evictable_pages:
                _store(pool, alloc, cache, tokens)
        elif op < 0.75 and len(users) < 3:
            tokens = seq()
            m = cache.match_prefix(tokens)
            cache.lock(m.node)
            m = cache.load_host(m)
            alloc.incref(m.pages)
            assert _rows_ok(pool, tokens, m.pages)
            users.append((m.node, m.pages))
        elif op < 0.9 and users:
            node, pages = users.pop(rng.randrange(len(users)))
            cache.unlock(node)
            alloc.free(pages)
        else:
            cache.evict(rng.randint(1, 6))
        _check(cache, alloc, host)  # the requests' pages are all cached pages (locked)
    for node, pages in users:
        cache.unlock(node)
        alloc.free(pages)
    cache.reset()
    assert alloc.num_free == 24 and host.num_free == 16 and cache.cached_pages == cache.host_cached_pages == 0


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    return Engine.from_pretrained(tiny, page_size=PS, num_pages=256, enable_prefix_cache=False)


def conversation_turns(engine: Engine, reference: Engine, sessions: int = 4, turns: int = 2) -> None:
    """Multi-turn chats sharing a system prompt, a turn of every chat at a time: replies equal the
    reference's (an engine without a prefix cache)."""
    system = list(range(1, 26))
    chats = [system + [100 + i] * 5 for i in range(sessions)]
    for turn in range(turns):
        got = [o.token_ids for o in engine.generate(chats, GREEDY)]
        assert got == [o.token_ids for o in reference.generate(chats, GREEDY)], turn
        chats = [c + g + [200 + turn] * 3 for c, g in zip(chats, got, strict=True)]


def test_greedy_tokens_equal_with_a_host_tier_that_pages_are_offloaded_to_and_loaded_from(reference) -> None:
    engine = Engine(reference.model, page_size=PS, num_pages=16, max_prefill_tokens=64, host_kv_pages=48)
    conversation_turns(engine, reference)
    st = engine.tier_stats()
    assert st["host_hit_pages"] > 0 and st["offloaded_bytes"] > 0 and st["loaded_bytes"] > 0
    stats = engine.stats()
    assert stats["host_used_pages"] == stats["host_cached_pages"] > 0
    engine.flush_prefix_cache()
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["host_used_pages"] == 0


def test_the_host_tier_is_sized_in_gib_and_refused_where_it_cannot_run(reference) -> None:
    engine = Engine(reference.model, page_size=PS, num_pages=16, host_kv_cache_gb=0.001)
    page = engine.kv_pool.bytes_per_page * engine.config.num_hidden_layers
    assert engine.stats()["host_total_pages"] == int(0.001 * (1 << 30)) // page
    with pytest.raises(ValueError, match="host KV tier"):
        Engine(reference.model, page_size=PS, num_pages=16, host_kv_pages=8, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="host_kv_pages"):
        Engine(reference.model, page_size=PS, num_pages=16, host_kv_pages=-1)


def test_host_pool_copies_on_cpu_need_no_fence() -> None:
    pool = KVPool(LAYERS, 4, PS, ROW)
    host = HostKVPool(pool, 4)
    pool.buffer.copy_(torch.arange(pool.buffer.numel(), dtype=torch.float32).view_as(pool.buffer))
    before = pool.buffer.clone()
    assert host.to_host([2, 0], [1, 3]) is None
    pool.buffer.zero_()
    assert host.to_device([3, 1], [1, 2]) is None
    assert torch.equal(pool.buffer[:, PS : 2 * PS], before[:, 0:PS])
    assert torch.equal(pool.buffer[:, 2 * PS : 3 * PS], before[:, 2 * PS : 3 * PS])


def test_an_fp8_pools_row_bytes_and_scales_round_trip_through_the_host() -> None:
    from libs.engine.kv_fp8 import Fp8Rows

    pool = KVPool(LAYERS, 4, PS, 12, fp8=Fp8Rows(8, 4))
    host = HostKVPool(pool, 2)
    assert host.page_bytes == LAYERS * pool.bytes_per_page  # the stored row (codes, rope, scale), not row_dim
    pool.buffer.copy_(torch.randint(0, 255, pool.buffer.shape, dtype=torch.uint8))
    before = pool.buffer.clone()
    host.to_host([3], [1])
    pool.buffer.zero_()
    host.to_device([1], [0])
    assert torch.equal(pool.buffer[:, :PS], before[:, 3 * PS : 4 * PS])
