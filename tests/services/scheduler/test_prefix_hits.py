"""PrefixClient.hits over the local index: per worker, the longer of its indexed run and the scheduler's
own recent placements, in tokens, and the longest over the page sizes the live workers use."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from libs.prefix import block_hashes
from libs.prefix.index import PrefixIndex
from proto.messages import KvSnapshot
from services.scheduler.prefix_lookup import PrefixClient


def client(index: PrefixIndex) -> PrefixClient:
    replica = SimpleNamespace(index=index)
    return PrefixClient(None, CollectorRegistry(), 0.05, 5.0, lambda: 100.0, replica)  # type: ignore[arg-type]


def test_hits_take_the_longer_of_index_and_recent_placements_per_worker() -> None:
    prompt = list(range(3, 3 + 65))  # 64 tokens count (the last is never a hit): 4 pages of 16, 8 of 8
    h16, h8 = block_hashes(prompt[:-1], 16), block_hashes(prompt[:-1], 8)
    index = PrefixIndex()
    for wid, hashes in {"a": h16[:3], "b": h16[:1], "c": h8[:7]}.items():
        index.load_snapshot(KvSnapshot(worker_id=wid, epoch="e", seq=0, hashes=hashes), 100.0)
    c = client(index)
    c.placed(prompt, "b", 16)  # b was just sent the whole prompt: 4 pages are coming
    c.placed(prompt, "d", 8)
    hits = asyncio.run(c.hits(prompt, [16, 8, 16]))
    assert hits == {"a": 48, "b": 64, "c": 56, "d": 64}
    assert asyncio.run(c.hits(prompt, [16])) == {"a": 48, "b": 64}
    assert asyncio.run(c.hits(prompt[:10], [16])) == {}  # no full page: nothing to look up
