"""The worker side of the KV tiers: the store namespace names the checkpoint and KV layout (equal for
equal checkpoints, different for different weights or page sizes, or as set), the tier metrics read
the engine's counters at scrape time, and an idle worker's store results are taken without a step."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from libs.engine import Engine, SamplingParams
from libs.engine.page_store import InProcessPageStore
from libs.engine.radix_cache import Tier
from libs.engine.tiny import write_tiny_model
from libs.worker.engine_thread import EngineThread
from libs.worker.kv_tiers import KvTierCollector, store_namespace, take_store_results
from libs.worker.settings import WorkerSettings


def test_the_store_namespace_names_checkpoint_and_layout(tmp_path: Path) -> None:
    a, b, c = (write_tiny_model(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    engines = {ps: Engine.from_pretrained(a, page_size=ps, num_pages=8) for ps in (4, 8)}

    def ns(path: Path, ps: int = 4, **kw: str) -> str:
        return store_namespace(WorkerSettings(model_dir=str(path), **kw), engines[ps])

    assert ns(a) == ns(b) != ns(c)  # the same weights in two folders share pages; other weights do not
    assert ns(a, 4) != ns(a, 8)
    assert ns(a, kv_store_namespace="mine") == "mine"


def test_tier_metrics_read_the_engines_counters(tmp_path: Path) -> None:
    engine = Engine.from_pretrained(
        write_tiny_model(tmp_path / "m", seed=0), page_size=4, num_pages=12, host_kv_pages=16
    )
    registry = CollectorRegistry()
    registry.register(KvTierCollector(engine))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for p in (list(range(3, 30)), list(range(40, 67)), list(range(3, 30))):  # the third comes back from host
        engine.generate([p], params)
    text = generate_latest(registry).decode()
    st = engine.tier_stats()
    assert st["host_hit_pages"] > 0
    assert f'moemesh_kv_tier_hit_pages_total{{tier="host"}} {float(st["host_hit_pages"])}' in text
    assert 'moemesh_kv_host_pages{state="total"} 16.0' in text
    assert "moemesh_kv_store_up" not in text  # no store attached


class _Listener:
    """A worker's KV event listener as far as the store is concerned: the runs the store now holds."""

    def __init__(self) -> None:
        self.in_store: list[int] = []

    def blocks_stored(self, hashes: list[int]) -> None:
        pass

    def blocks_removed(self, hashes: list[int]) -> None:
        pass

    def blocks_moved(self, hashes: list[int], tier: int) -> None:
        if tier == int(Tier.STORE):
            self.in_store += hashes


async def test_an_idle_workers_store_puts_are_taken_without_a_step(tmp_path: Path) -> None:
    """The put of a finished request's pages comes back after its last step: StoreResults takes it on the
    engine thread with no step to come (the host pages freed, the bytes counted, the store's blocks told)."""
    engine = Engine.from_pretrained(
        write_tiny_model(tmp_path / "m", seed=0), page_size=4, num_pages=32, host_kv_pages=32
    )
    store = InProcessPageStore()
    tier = engine.attach_store(store, "ns", retry_s=0.05)
    et = EngineThread(engine)
    try:
        listener = _Listener()
        await et.call(engine.set_cache_listener, listener)
        called = asyncio.Event()
        et.after_call = called.set  # after every engine call, the polls StoreResults queues too
        assert take_store_results(et) is not None
        async with asyncio.timeout(10):
            while not tier.available:
                await asyncio.sleep(0.005)  # the store's thread connecting: nothing to wait on but its state
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        await et.call(engine.generate, [list(range(3, 40))], params)  # 9 whole pages, put after its last step
        assert not engine.has_unfinished()  # idle: nothing steps, nor polls, from here on
        async with asyncio.timeout(10):
            while True:
                called.clear()
                st = engine.tier_stats()
                if st["store_published_pages"] >= 9 and tier.pages_in_flight == 0:
                    break
                await called.wait()
        assert len(store.pages) >= 9 and len(listener.in_store) >= 9
        assert engine.stats()["host_used_pages"] == 0
    finally:
        et.shutdown()
        engine.close()
