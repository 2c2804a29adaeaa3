"""The prefill worker with warm-up on (the default on CUDA; asked for here on the CPU): it has warmed up by
the time it serves, its pool is whole again, the time is exported, and a task afterwards still lands the
engine's KV and first token."""

from __future__ import annotations

from libs.engine import Engine
from proto import messages as m
from tests.services.prefill_worker.conftest import Rig
from tests.services.prefill_worker.test_service import PROMPT, reference_prefill, same_kv


async def test_warmed_up_before_serving_with_every_page_free(make_rig, reference: Engine) -> None:
    rig: Rig = await make_rig(warmup="on", max_prefill_tokens=48)
    w = rig.worker
    assert w.registry.get_sample_value("moemesh_worker_warmup_seconds") > 0
    st = w.engine.stats()
    assert (st["free_pages"], st["used_pages"], st["cached_pages"]) == (st["total_pages"], 0, 0)
    task = rig.task(PROMPT, [4, 5, 6])
    await rig.send(task)
    ready = await rig.next_inbox()
    assert isinstance(ready, m.KvReady), ready
    first, rows = reference_prefill(reference, PROMPT)
    assert ready.first_token.token_id == first
    same_kv(rig.decode.rows([4, 5, 6], len(PROMPT)), rows)
    await rig.settled()


async def test_warmup_is_off_on_the_cpu_by_default(make_rig) -> None:
    rig: Rig = await make_rig()
    assert rig.worker.registry.get_sample_value("moemesh_worker_warmup_seconds") == 0
