"""The store tier with an in-process page store: a prompt computed by one engine is served to another from
the store with the same greedy tokens; a store that is down, or too slow, means recompute (same tokens, no
error) and service resumes when it is back; no host page is left held."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from libs.engine import Engine, SamplingParams
from libs.engine.page_store import InProcessPageStore
from libs.engine.tiny import write_tiny_model

PS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 40))  # 9 whole pages before the last token


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)
    return Engine.from_pretrained(path, page_size=PS, num_pages=128, enable_prefix_cache=False)


def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)  # another thread's progress: nothing to wait on but its state


def tiered(reference: Engine, store, **kw) -> Engine:
    engine = Engine(reference.model, page_size=PS, num_pages=64, host_kv_pages=32)
    tier = engine.attach_store(store, "test-ns", **{"timeout_s": 2.0, "retry_s": 0.05, **kw})
    until(lambda: tier.available, "the store tier connected")
    return engine


def settle(engine: Engine) -> None:
    """Until the store thread's jobs are back, puts and fetches (a worker's engine thread polls every step)."""
    tier = engine.store_tier
    assert tier is not None

    def done() -> bool:
        tier.poll()
        return tier.pages_in_flight == 0

    until(done, "the store jobs finished")


def test_a_prompt_computed_on_one_engine_is_served_to_another_from_the_store(reference) -> None:
    store = InProcessPageStore()
    a, b = tiered(reference, store), tiered(reference, store)
    want = reference.generate([PROMPT], GREEDY)[0].token_ids
    assert a.generate([PROMPT], GREEDY)[0].token_ids == want
    settle(a)
    assert len(store.pages) >= len(PROMPT) // PS and all(k.startswith("test-ns:") for k in store.pages)
    out = b.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want and out.cached_tokens == 9 * PS
    st = b.tier_stats()
    assert st["store_hit_pages"] == 9 and st["store_fetched_bytes"] == 9 * st["page_bytes"]
    assert a.tier_stats()["store_published_pages"] >= 9
    for e in (a, b):
        settle(e)
        e.flush_prefix_cache()
        assert e.stats()["host_used_pages"] == 0 and e.stats()["free_pages"] == e.stats()["total_pages"]
        e.close()


def test_a_store_that_is_down_means_recompute_until_it_is_back(reference) -> None:
    store = InProcessPageStore()
    a = tiered(reference, store)
    want = reference.generate([PROMPT], GREEDY)[0].token_ids
    a.generate([PROMPT], GREEDY)
    settle(a)
    b = tiered(reference, store)
    store.down = True
    out = b.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want and out.cached_tokens == 0
    assert b.tier_stats()["store_failures"] >= 1
    b.flush_prefix_cache()
    store.down = False
    until(lambda: b.store_tier is not None and b.store_tier.available, "the tier back up")
    out = b.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want and out.cached_tokens == 9 * PS
    for e in (a, b):
        e.close()


class SlowStore(InProcessPageStore):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def exists(self, names: Sequence[str]) -> list[bool]:
        self.release.wait(10)
        return super().exists(names)


def test_a_request_waits_for_a_slow_store_no_longer_than_its_timeout(reference) -> None:
    store = SlowStore()
    b = tiered(reference, store, timeout_s=0.2)
    want = reference.generate([PROMPT], GREEDY)[0].token_ids
    out = b.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want and out.cached_tokens == 0
    assert (
        b.tier_stats()["store_failures"] == 1 and b.store_tier is not None and not b.store_tier.pending("x")
    )
    store.release.set()
    settle(b)
    b.flush_prefix_cache()
    assert b.stats()["host_used_pages"] == 0
    b.close()


def test_the_store_tier_needs_a_host_tier(reference) -> None:
    engine = Engine(reference.model, page_size=PS, num_pages=16)
    with pytest.raises(ValueError, match="host tier"):
        engine.attach_store(InProcessPageStore(), "ns")
