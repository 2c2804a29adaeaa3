"""Prefix-cache block events (what workers publish for prefix-aware routing) and the PD decode side
keeping what it received: a follow-up prompt reuses it and receives only the pages after it."""

from __future__ import annotations

import pytest

from libs.engine import Engine, SamplingParams
from libs.engine.loader import load_model
from libs.engine.pages import PageAllocator
from libs.engine.radix_cache import RadixCache
from libs.engine.tiny import write_tiny_model
from libs.prefix import block_hashes
from tests.libs.cache_recorder import Recorder

PS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _store(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> None:
    pages = alloc.alloc(-(-len(tokens) // PS))
    cache.insert(tokens, pages)
    alloc.free(pages)


def _cache_with_listener(num_pages: int = 32) -> tuple[PageAllocator, RadixCache, Recorder]:
    alloc, rec = PageAllocator(num_pages), Recorder()
    cache = RadixCache(alloc, PS)
    cache.set_listener(rec)
    return alloc, cache, rec


def test_stored_runs_carry_the_chained_hashes_of_the_new_pages_only() -> None:
    alloc, cache, rec = _cache_with_listener()
    a = list(range(12))
    b = list(range(8)) + [50, 51, 52, 53, 54]  # shares two pages with a; a partial page is never a block
    _store(alloc, cache, a)
    _store(alloc, cache, b)
    assert rec.events == [("stored", block_hashes(a, PS)), ("stored", block_hashes(b, PS)[2:])]
    assert rec.held() == set(block_hashes(a, PS)) | set(block_hashes(b, PS))


def test_split_keeps_hashes_and_eviction_reports_exactly_what_left() -> None:
    alloc, cache, rec = _cache_with_listener()
    _store(alloc, cache, list(range(12)))
    cache.match_prefix(list(range(4)) + [9, 9, 9, 9])  # splits the 3-page edge after its first page
    _store(alloc, cache, list(range(4)) + [9, 9, 9, 9])  # a sibling under the split point
    rec.events.clear()
    cache.evict(1)  # LRU leaf: the tail of the first sequence (2 pages)
    assert rec.events == [("removed", block_hashes(list(range(12)), PS)[1:])]
    rec.events.clear()
    cache.reset()  # the sibling, then the shared first page once it became a leaf
    assert all(kind == "removed" for kind, _ in rec.events) and cache.cached_pages == 0
    assert sorted(h for _, hs in rec.events for h in hs) == sorted(block_hashes(list(range(4)) + [9] * 4, PS))


def test_two_caches_given_the_same_tokens_report_the_same_blocks() -> None:
    """Two workers cache the same prompt through different histories: the broker sees one block set."""
    (a_alloc, a, a_rec), (b_alloc, b, b_rec) = _cache_with_listener(), _cache_with_listener()
    prompt = [(5 * i + 1) % 97 for i in range(18)]
    _store(a_alloc, a, prompt)
    _store(b_alloc, b, prompt[:8])  # b first caches a shorter prefix, then the whole prompt
    _store(b_alloc, b, prompt)
    assert a_rec.held() == b_rec.held() == set(block_hashes(prompt, PS))


def test_a_listener_set_late_hears_what_is_cached_already() -> None:
    alloc = PageAllocator(32)
    cache = RadixCache(alloc, PS)
    _store(alloc, cache, list(range(12)))
    _store(alloc, cache, list(range(8)) + [7, 7, 7, 7])
    rec = Recorder()
    cache.set_listener(rec)
    assert rec.held() == set(block_hashes(list(range(12)), PS)) | set(
        block_hashes(list(range(8)) + [7, 7, 7, 7], PS)
    )
    cache.reset()
    assert rec.held() == set()


# --- the engine's PD decode side -----------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=1)
    return load_model(ckpt, progress=False)


def _engine(model, **kw) -> Engine:
    return Engine(model, page_size=PS, num_pages=kw.pop("num_pages", 64), max_prefill_tokens=64, **kw)


def _pd(prefill: Engine, decode: Engine, rid: str, prompt: list[int], reuse: bool) -> tuple[list[int], int]:
    """One PD request: prefill, copy only the pages the decode side reserved, decode to the end."""
    res = prefill.prefill(rid, prompt, GREEDY)
    if reuse:
        cached, pages = decode.reserve_cached(rid, prompt)
    else:
        cached, pages = 0, decode.reserve(rid, len(prompt))
    src_pages = res.page_ids[cached // PS :]
    assert len(pages) == len(src_pages)
    src = prefill.kv_pool.buffer.view(prefill.kv_pool.num_layers, 64, PS, -1)
    dst = decode.kv_pool.buffer.view(decode.kv_pool.num_layers, 64, PS, -1)
    dst[:, pages] = src[:, src_pages]  # what the KV transfer writes
    prefill.release(rid)
    decode.add_prefilled(rid, prompt, res.first_token, GREEDY)
    tokens = [res.first_token]
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.token_ids
    return tokens, cached


def test_decode_side_caches_what_it_received_and_reuses_it_for_the_next_turn(model) -> None:
    prefill, decode = _engine(model), _engine(model)
    rec = Recorder()
    decode.set_cache_listener(rec)
    turn1 = [(3 * i + 11) % 500 for i in range(21)]
    out1, cached1 = _pd(prefill, decode, "t1", turn1, reuse=True)
    assert cached1 == 0
    # already true before prefix routing: a finished prefilled request's pages enter the decode cache
    # (prompt + every generated token but the newest, whose KV was never computed)
    computed = turn1 + out1[:-1]
    assert decode.cache is not None
    assert decode.cache.match_prefix(computed).length == len(computed) // PS * PS
    assert rec.held() == set(block_hashes(computed, PS))

    turn2 = turn1 + out1 + [7, 8, 9, 10, 11]
    out2, cached2 = _pd(prefill, decode, "t2", turn2, reuse=True)
    assert cached2 == len(computed) // PS * PS > 0
    solo = _engine(model, enable_prefix_cache=False)
    assert out2 == solo.generate([turn2], GREEDY)[0].token_ids  # reused KV gives the same tokens
    # the shared part is held once: the cache is exactly turn 2's computed blocks, nothing duplicated
    assert decode.cache.cached_pages == len(block_hashes(turn2 + out2[:-1], PS))
    assert rec.held() == set(block_hashes(turn2 + out2[:-1], PS))
    decode.flush_prefix_cache()
    assert decode.stats()["free_pages"] == decode.stats()["total_pages"]


def test_reserve_cached_is_released_by_cancel_and_survives_eviction_pressure(model) -> None:
    decode = _engine(model, num_pages=12)
    prompt = list(range(40, 61))  # 21 tokens: 5 full pages + 1
    decode.generate([prompt], SamplingParams(max_tokens=1))  # caches 5 pages
    cached, pages = decode.reserve_cached("r", prompt + [1, 2])
    assert cached == 20 and len(pages) == 1
    with pytest.raises(Exception, match="out of KV pages"):
        decode.reserve("big", 40)  # may evict only unlocked pages: the reservation's prefix is locked
    assert decode.cache is not None and decode.cache.match_prefix(prompt).length == 20
    assert decode.cancel_reservation("r")
    assert decode.cache.evictable_pages == decode.cache.cached_pages == 5
    decode.flush_prefix_cache()
    assert decode.stats()["free_pages"] == 12 and not decode.reservations
    with pytest.raises(ValueError, match="prompt is empty"):
        decode.reserve_cached("x", [])


def _counting_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pages the radix cache hashes itself from now on (its extend_hashes calls, in pages)."""
    import libs.engine.radix_cache as rc

    hashed: list[int] = []
    real = rc.extend_hashes

    def counted(parent, tokens, page_size):
        hashed.append(len(tokens) // page_size)
        return real(parent, tokens, page_size)

    monkeypatch.setattr(rc, "extend_hashes", counted)
    return hashed


def test_known_hashes_are_reused_where_they_chain_else_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """insert(tokens, pages, hashes): a PD prompt's hashes from the prefill side name its new pages after a
    one-page check; hashes that do not continue this cache's chain (another page size, other tokens) are
    dropped and the pages hashed here: the events are the true block hashes either way."""
    hashed = _counting_hashes(monkeypatch)
    alloc, cache, rec = _cache_with_listener()
    shared = list(range(8))
    _store(alloc, cache, shared)  # two pages cached already
    seq = shared + [(7 * i + 3) % 97 for i in range(18)]  # + 4 whole pages and a partial one
    truth = block_hashes(seq, PS)
    hashed.clear()
    pages = alloc.alloc(-(-len(seq) // PS))
    cache.insert(seq, pages, truth[:5])  # known for the first five pages: pages 2-4 reused, page 5 computed
    assert rec.events[-1] == ("stored", truth[2:])
    assert hashed == [1, 1]  # the check of page 2, then page 5 after the known ones
    for bad in (block_hashes(seq, 2)[:6], [h ^ 1 for h in truth]):  # another page size; a broken chain
        cache.reset()
        rec.events.clear()
        _store(alloc, cache, shared)
        hashed.clear()
        cache.insert(seq, pages, bad)
        assert rec.events[-1] == ("stored", truth[2:])
        assert hashed == [1, 4]  # the failed check, then every new page
    alloc.free(pages)


def test_pd_prompt_hashes_travel_with_the_prefill_result(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill side's result carries its cache's hashes of the prompt; the decode side, given them,
    hashes only the pages after the prompt when the request ends, and reports the same blocks."""
    prefill, decode = _engine(model), _engine(model)
    prefill.set_cache_listener(Recorder())
    rec = Recorder()
    decode.set_cache_listener(rec)
    prompt = [(3 * i + 11) % 500 for i in range(21)]  # 5 whole pages
    res = prefill.prefill("p", prompt, GREEDY)
    assert res.block_hashes == block_hashes(prompt, PS)
    pages = decode.reserve("p", len(prompt))
    src = prefill.kv_pool.buffer.view(prefill.kv_pool.num_layers, 64, PS, -1)
    dst = decode.kv_pool.buffer.view(decode.kv_pool.num_layers, 64, PS, -1)
    dst[:, pages] = src[:, res.page_ids]
    prefill.release("p")
    hashed = _counting_hashes(monkeypatch)
    decode.add_prefilled("p", prompt, res.first_token, GREEDY, res.block_hashes)
    out = [res.first_token]
    while decode.has_unfinished():
        for o in decode.step():
            out += o.token_ids
    computed = prompt + out[:-1]  # 26 tokens: 6 whole pages
    assert rec.held() == set(block_hashes(computed, PS))
    assert hashed == [1, 1]  # the one-page check, then the sixth page (prompt tail + outputs)
