"""Which pool a KV handle names: the worker's one pool or one rank's own (pure rules over wire records)."""

from __future__ import annotations

import pytest

from libs.kvtransfer.ranks import join_rank_pages, sessions, split_rank_pages, target_pool
from proto import messages as m
from tests.services.kv_broker.factories import geometry, worker


def ranked(n: int = 2) -> m.WorkerRecord:
    pools = [
        m.KvRankPool(rank=r, session_id=f"127.0.0.1:{2000 + r}", geometry=geometry(32 + r)) for r in range(n)
    ]
    return m.WorkerRecord(
        worker_id="decode-ep", role=m.Role.DECODE, session_id=pools[0].session_id, geometry=pools[0].geometry,
        ranks=pools,
    )  # fmt: skip


def test_one_pool_worker_takes_rank_minus_one_only() -> None:
    w = worker()
    assert target_pool(w, -1) == (w.session_id, w.geometry)
    with pytest.raises(ValueError, match="no KV pool of rank 0"):
        target_pool(w, 0)


def test_per_rank_worker_gives_each_rank_its_own_session_and_layout() -> None:
    w = ranked(3)
    for r in range(3):
        assert target_pool(w, r) == (f"127.0.0.1:{2000 + r}", geometry(32 + r))
    with pytest.raises(ValueError, match="must name its decode_rank"):
        target_pool(w, -1)
    with pytest.raises(ValueError, match=r"no KV pool of rank 3 \(its rank pools: \[0, 1, 2\]\)"):
        target_pool(w, 3)
    assert sessions(w) == {"127.0.0.1:2000", "127.0.0.1:2001", "127.0.0.1:2002"}


def test_split_rank_pages_round_trips_and_refuses_pages_of_two_ranks() -> None:
    assert split_rank_pages([20, 21, 23], 10) == (2, [0, 1, 3])
    assert join_rank_pages(2, [0, 1, 3], 10) == [20, 21, 23]
    assert split_rank_pages([0, 9], 10) == (0, [0, 9])
    with pytest.raises(ValueError, match="do not belong to one rank"):
        split_rank_pages([9, 10], 10)
    with pytest.raises(ValueError, match="no pages"):
        split_rank_pages([], 10)
    with pytest.raises(ValueError, match="pages_per_rank"):
        split_rank_pages([1], 0)


def test_rank_pools_survive_the_wire() -> None:
    import proto

    w = ranked(2)
    msg = m.RegisterWorker(
        worker_id=w.worker_id, role=w.role, session_id=w.session_id, geometry=w.geometry, ranks=w.ranks
    )
    assert proto.decoder(m.RegisterWorker).decode(proto.encode(msg)) == msg
    h = m.KvHandle(
        handle_id="h", request_id="r", decode_worker=w.worker_id, session_id="127.0.0.1:2001", page_ids=[3],
        num_tokens=5, lease_expires_ms=1, decode_rank=1,
    )  # fmt: skip
    assert proto.decoder(m.KvHandle).decode(proto.encode(h)).decode_rank == 1
    old = m.KvHandle(handle_id="h", request_id="r", decode_worker="d", session_id="s", page_ids=[3], num_tokens=5,
                     lease_expires_ms=1)  # fmt: skip
    assert proto.decoder(m.KvHandle).decode(proto.encode(old)).decode_rank == -1  # one pool by default
