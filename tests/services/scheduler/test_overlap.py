"""overlap_prefill (on by default): the scheduler starts the prompt on the prefill worker (PrefillStart)
alongside the ReserveKv, sends the PrefillTask with the handle after it, and abandons the start when the
reservation fails; off, only the PrefillTask goes."""

from __future__ import annotations

from proto import messages as m
from tests.services.scheduler.test_service import _get, start  # noqa: F401 (the fixture)


async def test_start_goes_out_before_the_task_with_the_same_prompt(start) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0)  # the default
    await h.decode("d0")
    p = await h.prefill("p0")
    assert (await h.submit("r1", prompt_len=100)).ok
    first, second = await _get(p.inbox), await _get(p.inbox)
    assert isinstance(first, m.PrefillStart) and isinstance(second, m.PrefillTask)
    assert first.request_id == second.request_id == "r1" and first.prompt_ids == second.prompt_ids
    assert second.handle.decode_worker == h.wid("d0")


async def test_a_refused_reservation_abandons_the_start(start) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0, overlap_prefill=True, max_retries=0)
    await h.decode("d0", refuse=True)
    p = await h.prefill("p0")
    assert (await h.submit("r1", prompt_len=100)).ok
    first, second = await _get(p.inbox), await _get(p.inbox)
    assert isinstance(first, m.PrefillStart) and second == m.PrefillAbandon(request_id="r1")
    err = await _get(h.errors)
    assert err.request_id == "r1" and p.inbox.empty()


async def test_off_only_the_task_is_sent(start) -> None:  # noqa: F811
    h = await start(direct_prefill_threshold=0, overlap_prefill=False)
    await h.decode("d0")
    p = await h.prefill("p0")
    assert (await h.submit("r1", prompt_len=100)).ok
    assert isinstance(await _get(p.inbox), m.PrefillTask)
    await h.until(lambda: h.metric("moemesh_scheduler_placements_total", kind="disaggregated") == 1)
    assert p.inbox.empty()
