"""Run N EP ranks as threads of the test process over the in-process hub (no spawn, no gloo)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

from libs.engine.engine import Engine
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.ep.comm import InProcessHub
from libs.ep.dispatch.all_to_all import AllToAllDispatcher
from libs.ep.placement import Placement
from libs.ep.rank import RankWorker
from libs.ep.runtime import enable_expert_parallel, shard_experts


def run_ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) on n threads at once; results in rank order; the first exception is re-raised."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    return results


def inprocess_group(
    model: DeepseekV3ForCausalLM, placement: Placement, fp8: bool = False, **engine_kwargs: Any
) -> list[RankWorker]:
    """One RankWorker per rank, each with a deep copy of `model` cut to its experts."""
    hub = InProcessHub(placement.ep_size)
    workers = []
    for r in range(placement.ep_size):
        m = copy.deepcopy(model)
        shard_experts(m, placement, r)
        comm = hub.comm(r)
        runtime = enable_expert_parallel(
            m, placement, r, AllToAllDispatcher(comm, placement.slots_per_rank, fp8), comm
        )
        workers.append(RankWorker(r, Engine(m, **engine_kwargs), runtime))
    return workers
