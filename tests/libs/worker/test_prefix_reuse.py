"""PD prefix reuse helpers and the KV event batching of workers (pure parts)."""

from __future__ import annotations

import pytest

from libs.worker.kv_events import REMOVED, coalesce
from libs.worker.prefix_reuse import pages_to_send, reserve_for
from proto import messages as m


class StubEngine:
    def __init__(self, cached: int) -> None:
        self.cached, self.calls = cached, []

    def reserve(self, rid, num_tokens):
        self.calls.append(("reserve", rid, num_tokens))
        return list(range(-(-num_tokens // 4)))

    def reserve_cached(self, rid, prompt_ids):
        self.calls.append(("reserve_cached", rid, len(prompt_ids)))
        return self.cached, list(range(-(-(len(prompt_ids) - self.cached) // 4)))


def handle(page_ids: list[int], cached_tokens: int) -> m.KvHandle:
    return m.KvHandle(
        handle_id="h", request_id="r", decode_worker="d0", session_id="s", page_ids=page_ids, num_tokens=10,
        lease_expires_ms=0, cached_tokens=cached_tokens,
    )  # fmt: skip


def test_reserve_reuses_the_cache_only_when_the_prompt_comes_along() -> None:
    eng = StubEngine(cached=8)
    assert reserve_for(eng, m.ReserveKv(request_id="a", num_tokens=10, lease_ms=1)) == (0, [0, 1, 2])
    assert reserve_for(
        eng, m.ReserveKv(request_id="b", num_tokens=10, lease_ms=1, prompt_ids=list(range(10)))
    ) == (
        8,
        [0],
    )
    assert eng.calls == [("reserve", "a", 10), ("reserve_cached", "b", 10)]
    with pytest.raises(ValueError, match="3 prompt ids but num_tokens 10"):
        reserve_for(eng, m.ReserveKv(request_id="c", num_tokens=10, lease_ms=1, prompt_ids=[1, 2, 3]))


def test_prefill_sends_only_the_pages_past_the_decode_sides_cache() -> None:
    src = [40, 41, 42, 43]  # the prompt's pages on the prefill side (page_size 4: 13..16 tokens)
    assert pages_to_send(src, handle([7, 8, 9, 10], 0), 4) == src
    assert pages_to_send(src, handle([9, 10], 8), 4) == [42, 43]
    with pytest.raises(ValueError, match="whole number"):
        pages_to_send(src, handle([9, 10], 6), 4)
    with pytest.raises(ValueError, match="at least its last token"):
        pages_to_send(src, handle([], 16), 4)
    with pytest.raises(ValueError, match="has 1 pages, the prompt needs 2"):
        pages_to_send(src, handle([9], 8), 4)


def test_events_are_coalesced_in_order_and_cut_to_size() -> None:
    pending = [(0, [1, 2]), (0, [3]), (REMOVED, [2]), (REMOVED, []), (0, [2, 4, 5, 6, 7]), (1, [1]), (2, [1])]
    assert coalesce(pending, 3) == [
        (0, [1, 2, 3]), (REMOVED, [2]), (0, [2, 4, 5]), (0, [6, 7]), (1, [1]), (2, [1])
    ]  # fmt: skip
    assert coalesce([], 3) == []
