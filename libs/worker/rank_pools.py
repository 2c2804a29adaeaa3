"""PD with per-rank KV pools (libs.ep.rank_kv): an EP worker whose DP-attention ranks each register their
own pool names, for every request, the rank whose pool holds it: at start-up (`rank_pools`), in the decode
side's KvHandle (`handle_place`) and on the prefill side's write (`write_pages`)."""

# RegisterWorker.ranks carries the ranks' pools; the worker's own session and geometry fields carry rank 0's
# and the worker process registers no memory. A single-pool worker writes from its own transport.

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from libs.kvtransfer import KvTransport, PageGeometry, plan_page_runs
from libs.kvtransfer.ranks import split_rank_pages
from libs.worker.engine_thread import EngineThread
from proto import messages as m


def has_rank_pools(engine: Any) -> bool:
    return bool(getattr(engine, "rank_pools", None))


def rank_pools(engine: Any) -> list[m.KvRankPool]:
    """The KvRankPool of every rank (empty for an engine with one pool)."""
    if not has_rank_pools(engine):
        return []
    return [
        m.KvRankPool(rank=r, session_id=session, geometry=m.KvGeometry(**geom))
        for r, (session, geom) in enumerate(engine.rank_pools)
    ]


def handle_place(
    engine: Any, transport: KvTransport, rid: str, pages: list[int]
) -> tuple[str, int, list[int]]:
    """(session, decode_rank, page ids in that pool) for the pages `engine` reserved for `rid`: the
    worker's one pool (rank -1), or the pool of the rank that holds the request."""
    if not has_rank_pools(engine):
        return transport.session_id, -1, pages
    if not pages:  # the whole prompt was cached: nothing to place, the rank still named
        rank = engine.owner[rid]
        return engine.rank_pools[rank][0], rank, []
    rank, local = split_rank_pages(pages, engine.pages_per_rank)
    return engine.rank_pools[rank][0], rank, local


def write_rank_pages(
    engine: Any, et: EngineThread, src_pages: Sequence[int], session: str, dst: m.KvGeometry,
    dst_pages: Sequence[int],
) -> int:  # fmt: skip
    """Blocking (a transfer thread, never the engine thread): `src_pages` (global) into `dst_pages` of the
    pool `session` names, issued by the EP rank that holds them, through the engine thread; -> bytes."""
    layers = engine.config.num_hidden_layers
    geom = {f: getattr(dst, f) for f in m.KvGeometry.__struct_fields__}
    return et.run_blocking(engine.write_kv, list(src_pages), session, geom, list(dst_pages), layers)


async def write_pages(
    engine: Any, et: EngineThread, transport: KvTransport, src_pages: Sequence[int], handle: m.KvHandle,
    dst: m.KvGeometry,
) -> tuple[int, int]:  # fmt: skip
    """Write `src_pages` (the prefill engine's, global) into the handle's pages; -> (bytes, runs)."""
    dst_pages = handle.page_ids[: len(src_pages)]
    if has_rank_pools(engine):  # the rank holding the prompt writes from its own pool (on the engine thread)
        layers = engine.config.num_hidden_layers
        geom = {f: getattr(dst, f) for f in m.KvGeometry.__struct_fields__}
        nbytes = await et.call(engine.write_kv, list(src_pages), handle.session_id, geom, dst_pages, layers)
        return nbytes, -1
    src = PageGeometry.of_pool(engine.kv_pool)
    runs = plan_page_runs(src.num_layers, list(src_pages), dst_pages, src, dst)
    return await asyncio.to_thread(transport.write, handle.session_id, runs), len(runs)
