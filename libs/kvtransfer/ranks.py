"""Which pool a KV handle's pages live in: the worker's one pool, or one rank's own pool in an EP worker
whose DP-attention ranks keep their pools apart (proto `KvRankPool`; on GPUs each pool is on its rank's
device and registered with Mooncake by that rank's process). Pure functions over the wire records."""

# Who uses what: the decode worker turns the global page ids its EP engine hands out into (rank, that rank's
# pages) with `split_rank_pages` and names the rank in the KvHandle; the kv-broker checks a handle against
# `target_pool`; the prefill worker writes into the session and layout `target_pool` gives.

from __future__ import annotations

from collections.abc import Sequence

from proto.messages import KvGeometry, WorkerRecord


def target_pool(worker: WorkerRecord, decode_rank: int) -> tuple[str, KvGeometry]:
    """(Mooncake session, pool layout) that a handle naming `decode_rank` writes into (-1: the one pool)."""
    if decode_rank < 0:
        if worker.ranks:
            raise ValueError(
                f"{worker.worker_id} keeps one KV pool per rank ({len(worker.ranks)} ranks): a handle into it "
                "must name its decode_rank"
            )
        return worker.session_id, worker.geometry
    for pool in worker.ranks:
        if pool.rank == decode_rank:
            return pool.session_id, pool.geometry
    have = sorted(p.rank for p in worker.ranks)
    raise ValueError(f"{worker.worker_id} has no KV pool of rank {decode_rank} (its rank pools: {have})")


def sessions(worker: WorkerRecord) -> set[str]:
    """Every Mooncake session of this incarnation of the worker (one, or one per rank)."""
    return {worker.session_id, *(p.session_id for p in worker.ranks)}


def split_rank_pages(pages: Sequence[int], pages_per_rank: int) -> tuple[int, list[int]]:
    """Global page ids of an EP engine (rank r's page p is r * pages_per_rank + p) -> (r, [p, ...]). A
    request's pages all belong to the one rank that holds it."""
    if pages_per_rank <= 0:
        raise ValueError(f"pages_per_rank must be positive, got {pages_per_rank}")
    if not pages:
        raise ValueError("no pages to place")
    ranks = {p // pages_per_rank for p in pages}
    if len(ranks) != 1 or min(pages) < 0:
        raise ValueError(f"pages {list(pages)[:8]} do not belong to one rank of {pages_per_rank} pages each")
    rank = ranks.pop()
    return rank, [p - rank * pages_per_rank for p in pages]


def join_rank_pages(rank: int, pages: Sequence[int], pages_per_rank: int) -> list[int]:
    """The inverse of split_rank_pages."""
    return [rank * pages_per_rank + p for p in pages]
