"""KV tiers in the prefix index: a worker's run split into device and host blocks from its events and
snapshots, the shared store's blocks continuing the run of every worker that reads the store, and the
weighting placement applies (device > host > store > nothing)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from libs.prefix import block_hashes, tier_weighted
from libs.prefix.index import PrefixIndex
from proto.messages import BlocksRemoved, BlocksStored, KvSnapshot, KvTier
from services.scheduler.prefix_lookup import PrefixClient

H = list(range(100, 110))  # a prompt's block hashes


def stored(wid: str, seq: int, hashes: list[int], tier: KvTier = KvTier.DEVICE) -> BlocksStored:
    return BlocksStored(worker_id=wid, epoch="e", seq=seq, hashes=hashes, tier=tier)


def test_events_move_blocks_between_device_and_host() -> None:
    ix = PrefixIndex()
    ix.apply(stored("a", 1, H[:6]), 0.0)
    assert ix.tiered_overlap(H) == {"a": (6, 0, 0)} and not ix.has_tiers
    ix.apply(stored("a", 2, H[3:6], KvTier.HOST), 0.0)  # evicted to its host tier
    assert ix.tiered_overlap(H) == {"a": (3, 3, 0)} and ix.has_tiers
    assert ix.overlap(H) == {"a": 6}  # still held: the plain run counts it
    ix.apply(stored("a", 3, H[3:4]), 0.0)  # loaded back
    assert ix.tiered_overlap(H) == {"a": (4, 2, 0)}
    ix.apply(BlocksRemoved(worker_id="a", epoch="e", seq=4, hashes=H[4:6]), 0.0)
    assert ix.tiered_overlap(H) == {"a": (4, 0, 0)} and not ix.has_tiers


def test_store_blocks_continue_the_run_of_every_worker_that_reads_the_store() -> None:
    ix = PrefixIndex()
    ix.apply(stored("a", 1, H[:4]), 0.0)
    ix.apply(stored("a", 2, H[:8], KvTier.STORE), 0.0)  # a put its pages in the store
    ix.load_snapshot(KvSnapshot(worker_id="b", epoch="e", seq=0, hashes=H[:2], store=True), 0.0)
    ix.load_snapshot(KvSnapshot(worker_id="c", epoch="e", seq=0, hashes=[]), 0.0)  # no store tier
    ix.load_snapshot(KvSnapshot(worker_id="d", epoch="e", seq=0, hashes=[], store=True), 0.0)
    assert ix.tiered_overlap(H) == {"a": (4, 0, 4), "b": (2, 0, 6), "d": (0, 0, 8)}
    assert ix.blocks_of("a") == set(H[:4])  # a store put is not a block the worker holds


def test_a_snapshot_says_which_blocks_are_on_the_host() -> None:
    ix = PrefixIndex()
    ix.load_snapshot(KvSnapshot(worker_id="a", epoch="e", seq=5, hashes=H[:5], host_hashes=H[2:5]), 0.0)
    assert ix.tiered_overlap(H) == {"a": (2, 3, 0)}


def test_the_store_hint_is_bounded_oldest_first() -> None:
    ix = PrefixIndex(max_store_blocks=4)
    ix.apply(stored("a", 1, H[:6], KvTier.STORE), 0.0)
    assert ix.num_store_blocks == 4 and ix.tiered_overlap(H) == {}  # H[0], H[1] forgotten: no leading run


def test_weights_rank_device_over_host_over_store_over_nothing() -> None:
    device, host, store = (tier_weighted(b, 16, 0.8, 0.5) for b in ((4, 0, 0), (0, 4, 0), (0, 0, 4)))
    assert device == 64 > host == 51 > store == 32 > 0


def test_placement_hits_weigh_the_tiers() -> None:
    prompt = [7] * 64 + [1]  # four pages of 16 before the last token
    hashes = block_hashes(prompt[:-1], 16)
    ix = PrefixIndex()
    ix.apply(stored("gpu", 1, hashes), 0.0)
    ix.apply(stored("host", 1, hashes), 0.0)
    ix.apply(stored("host", 2, hashes, KvTier.HOST), 0.0)
    ix.apply(stored("gpu", 2, hashes, KvTier.STORE), 0.0)
    ix.load_snapshot(KvSnapshot(worker_id="store", epoch="e", seq=0, hashes=[], store=True), 0.0)
    replica = SimpleNamespace(index=ix)
    c = PrefixClient(
        None,
        CollectorRegistry(),
        0.05,
        5.0,
        lambda: 0.0,
        replica,
        tier_weights=(0.8, 0.5),  # type: ignore[arg-type]
    )
    hits = asyncio.run(c.hits(prompt, [16]))
    assert hits == {"gpu": 64, "host": 51, "store": 32}
