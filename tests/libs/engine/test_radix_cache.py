import pytest

from libs.engine.pages import PageAllocator
from libs.engine.radix_cache import RadixCache

PS = 4


def _fresh(num_pages=32):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, PS)


def _store(alloc, cache, tokens):
    """Simulate a finished request: own pages, insert into the cache, drop the request's references."""
    pages = alloc.alloc(-(-len(tokens) // PS))
    cache.insert(tokens, pages)
    alloc.free(pages)
    return pages


def test_match_only_whole_pages():
    alloc, cache = _fresh()
    pages = _store(alloc, cache, list(range(10)))  # 2 full pages cached, the partial one freed
    assert cache.cached_pages == 2 and alloc.num_used == 2
    m = cache.match_prefix(list(range(10)) + [99])
    assert m.length == 8 and m.pages == pages[:2]
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 6])  # second page incomplete in the query
    assert m.length == 4 and m.pages == pages[:1]
    assert cache.match_prefix([1, 2, 3, 4]).length == 0


def test_divergent_suffix_splits_and_shares_the_prefix():
    alloc, cache = _fresh()
    a = list(range(12))
    b = list(range(8)) + [50, 51, 52, 53]
    pa = _store(alloc, cache, a)
    pb = alloc.alloc(3)
    assert cache.insert(b, pb) == 8  # two pages already there: only the third is taken
    alloc.free(pb)
    assert cache.cached_pages == 4 and alloc.num_used == 4
    assert cache.match_prefix(b).pages == pa[:2] + pb[2:]
    assert cache.match_prefix(a).pages == pa
    # a match that ends inside an edge splits it and still returns exactly the shared part
    assert cache.match_prefix(list(range(4)) + [7, 7, 7, 7]).pages == pa[:1]


def test_lock_protects_from_eviction_and_lru_order():
    alloc, cache = _fresh()
    old = list(range(100, 108))
    new = list(range(200, 208))
    _store(alloc, cache, old)
    _store(alloc, cache, new)
    cache.match_prefix(new)  # touch: `old` is now least recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix(old).length == 0 and cache.match_prefix(new).length == 8
    m = cache.match_prefix(new)
    cache.lock(m.node)
    assert cache.evictable_pages == 0
    assert cache.evict(10) == 0
    cache.unlock(m.node)
    assert cache.evictable_pages == 2
    assert cache.reset() == 2
    assert alloc.num_free == 32 and cache.cached_pages == 0


def test_lock_covers_ancestors_after_split():
    alloc, cache = _fresh()
    _store(alloc, cache, list(range(12)))
    m = cache.match_prefix(list(range(8)))  # splits the 3-page edge into 2 + 1
    cache.lock(m.node)
    assert cache.evictable_pages == 1
    assert cache.evict(5) == 1  # only the unlocked tail page
    assert cache.match_prefix(list(range(12))).length == 8
    cache.unlock(m.node)
    assert cache.reset() == 2 and alloc.num_free == 32


def test_evicting_a_page_a_request_still_holds_does_not_free_it():
    alloc, cache = _fresh(4)
    pages = alloc.alloc(2)
    cache.insert(list(range(8)), pages)  # the "request" keeps its references
    assert cache.evict(2) == 0  # entry dropped, memory still owned by the request
    assert cache.cached_pages == 0 and alloc.num_free == 2
    alloc.free(pages)
    assert alloc.num_free == 4


def test_unbalanced_unlock_raises():
    alloc, cache = _fresh()
    _store(alloc, cache, list(range(4)))
    node = cache.match_prefix(list(range(4))).node
    with pytest.raises(ValueError, match="unlock"):
        cache.unlock(node)
