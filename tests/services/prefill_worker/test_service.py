"""The prefill worker service against a real nats-server: a task's KV lands in the decode worker's
reserved pages and KvReady carries the engine's first token; a lease too close to its end, a transfer
that fails half-way and a cancel each end in PrefillFailed (the decode side frees its reservation), tell
the gateway when it must move the request, write nothing afterwards, and leave no page pinned."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.kvtransfer.base import TransferError
from proto import messages as m
from proto import subjects
from tests.service_helpers import engine_held
from tests.services.prefill_worker.conftest import DECODE, Rig

PROMPT = [(7 * i + 3) % 900 + 3 for i in range(40)]  # 40 tokens: 3 pages of 16, the last one partial
DST_PAGES = [9, 2, 3]  # not in order, and a run of two: the planner merges consecutive pages


def reference_prefill(engine: Engine, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """The first token and the prompt's KV rows [L, T, row] from the same checkpoint in this process."""
    rid = f"ref-{uuid.uuid4().hex}"
    res = engine.prefill(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ps = engine.page_size
    idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in res.page_ids])[: len(prompt)]
    rows = engine.kv_pool.buffer[:, idx].clone()
    engine.release(rid)
    return res.first_token, rows


def same_kv(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same rows up to float32 rounding (the two engines run on different threads); a wrong or
    missing page would be off by the size of the values themselves."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


async def test_the_kv_lands_in_the_reserved_pages_and_kv_ready_has_the_first_token(
    make_rig, reference
) -> None:
    rig: Rig = await make_rig()
    task = rig.task(PROMPT, DST_PAGES)
    await rig.send(task)
    ready = await rig.next_inbox()
    assert isinstance(ready, m.KvReady), ready
    first, rows = reference_prefill(reference, PROMPT)
    assert (ready.request_id, ready.handle_id, ready.first_token.token_id) == (
        task.request_id, task.handle.handle_id, first,
    )  # fmt: skip
    assert ready.prompt_ids == PROMPT and ready.prefill_worker == rig.worker.instance_id
    same_kv(rig.decode.rows(DST_PAGES, len(PROMPT)), rows)
    untouched = [p for p in range(rig.decode.buffer.shape[1] // rig.decode.page_size) if p not in DST_PAGES]
    assert not rig.decode.rows(untouched, len(untouched) * rig.decode.page_size).any()
    await rig.until(lambda: rig.written == [task.handle.handle_id], "HandleWritten at the broker")
    await rig.settled()
    # the first token went to the gateway before the KV (and KvReady says so): once, at offset 0
    assert ready.first_token_streamed
    assert rig.first_tokens() == {task.request_id: [first, 0]}


async def test_no_write_into_a_lease_that_ends_within_the_margin(make_rig) -> None:
    rig: Rig = await make_rig(lease_margin_ms=5_000)
    task = rig.task(PROMPT, DST_PAGES, lease_ms=2_000)  # live, but ends sooner than the margin
    await rig.send(task)
    failed = await rig.next_inbox()
    assert isinstance(failed, m.PrefillFailed) and failed.handle_id == task.handle.handle_id
    assert "lease" in failed.message
    err = await asyncio.wait_for(rig.stream.get(), 10)
    assert isinstance(err, m.RequestError) and (err.request_id, err.code) == (task.request_id, 503)
    assert err.worker_id == rig.worker.instance_id
    assert not rig.decode.buffer.any()  # nothing written into pages the decode side may reuse
    assert rig.written == []
    await rig.settled()


async def test_a_transfer_failing_half_way_fails_the_request_and_the_worker_serves_on(
    make_rig, reference
) -> None:
    rig: Rig = await make_rig()
    real_write = rig.worker.transport.write
    calls: list[int] = []

    def write_half_then_fail(session: str, runs):  # the link drops after half of the runs landed
        calls.append(len(runs))
        if len(calls) == 1:
            real_write(session, runs[: len(runs) // 2])
            raise TransferError("connection reset by peer")
        return real_write(session, runs)

    rig.worker.transport.write = write_half_then_fail  # type: ignore[method-assign]
    task = rig.task(PROMPT, DST_PAGES)
    await rig.send(task)
    failed = await rig.next_inbox()
    assert isinstance(failed, m.PrefillFailed) and failed.request_id == task.request_id
    assert "connection reset" in failed.message
    # the gateway had the first token before the transfer failed; the 503 that follows makes it migrate
    # the request with that token (services/gateway/migration.py)
    first, rows = reference_prefill(reference, PROMPT)
    batch = await asyncio.wait_for(rig.stream.get(), 10)
    assert isinstance(batch, m.TokenBatch) and batch.deltas[0].token_ids == [first], batch
    err = await asyncio.wait_for(rig.stream.get(), 10)
    assert isinstance(err, m.RequestError) and (err.request_id, err.code) == (task.request_id, 503)
    assert rig.decode.buffer.any() and calls[0] > 1  # the failure came after some bytes had landed
    assert rig.written == []
    await rig.settled()

    again = rig.task(PROMPT, DST_PAGES)  # the same prompt again: the transfer is whole this time
    await rig.send(again)
    ready = await rig.next_inbox()
    assert isinstance(ready, m.KvReady) and ready.request_id == again.request_id
    assert ready.first_token.token_id == first
    same_kv(rig.decode.rows(DST_PAGES, len(PROMPT)), rows)
    await rig.settled()


@pytest.mark.parametrize("where", ["at-the-broker-lookup", "in-the-prefill"])
async def test_a_cancel_while_the_task_runs_frees_the_reservation_without_writing(
    make_rig, where: str
) -> None:
    rig: Rig = await make_rig()
    task = rig.task(PROMPT, DST_PAGES)
    hold = threading.Event()  # "in-the-prefill": keeps the engine thread busy, so the prefill waits
    busy = asyncio.ensure_future(
        rig.worker.et.call(hold.wait, 30) if where == "in-the-prefill" else asyncio.sleep(0)
    )
    if where == "at-the-broker-lookup":
        rig.lookup_gate.clear()  # the destination's geometry is not known yet
    try:
        await rig.send(task)
        if where == "at-the-broker-lookup":
            await rig.until(lambda: task.request_id in rig.worker.active, "the task to start")
        else:  # past the lookup: the next step is the prefill, queued behind `hold`
            await rig.until(lambda: DECODE in rig.worker.dst_workers, "the task to look up the decode worker")
        await rig.bus.publish(subjects.CANCEL, m.Cancel(request_id=task.request_id, reason="client gone"))
        await rig.bus.flush()
        await rig.until(lambda: task.request_id in rig.worker.cancelled, "the worker to hear the cancel")
    finally:
        rig.lookup_gate.set()
        hold.set()
        await busy
    failed = await rig.next_inbox()
    assert isinstance(failed, m.PrefillFailed) and failed.handle_id == task.handle.handle_id
    assert failed.message == "cancelled"
    await rig.settled()
    assert not rig.decode.buffer.any() and rig.written == []
    # What the worker published for the cancelled task precedes what it publishes for the next one.
    nxt = rig.task(PROMPT[:20], [4, 5])
    await rig.send(nxt)
    ready = await rig.next_inbox()
    assert isinstance(ready, m.KvReady) and ready.request_id == nxt.request_id
    await rig.settled()
    # the gateway ended the request itself: no RequestError for a cancel, and no first token
    assert rig.first_tokens() == {nxt.request_id: [ready.first_token.token_id, 0]}
    await rig.settled()


@pytest.mark.parametrize("max_prompts", [0, 1])
async def test_tasks_that_arrive_together_share_forwards_and_each_kv_lands(
    make_rig, reference, max_prompts: int
) -> None:
    """Six tasks arrive while the engine thread is busy: they run in fewer forwards than tasks (chunked
    under a 64-token budget), and each one's KV lands in its own reserved pages with its own first token.
    With max_prefill_prompts=1 (the unbatched baseline) every forward holds one prompt."""
    rig: Rig = await make_rig(max_prefill_tokens=64, max_prefill_prompts=max_prompts)
    forwards: list[int] = []  # sequences per model forward
    real = rig.worker.engine.runner.forward_last

    def counted(chunks, *a, **kw):
        forwards.append(len(chunks))
        return real(chunks, *a, **kw)

    rig.worker.engine.runner.forward_last = counted  # type: ignore[method-assign]
    lengths = [40, 20, 33, 50, 17, 25]
    prompts = [[(11 * i + 5 * k) % 900 + 3 for i in range(n)] for k, n in enumerate(lengths)]
    first_page = 0
    tasks = []
    for p in prompts:
        n = -(-len(p) // rig.decode.page_size)
        tasks.append(rig.task(p, list(range(first_page, first_page + n))))
        first_page += n
    async with engine_held(rig.worker.et):  # engine calls made in the block queue behind it
        for t in tasks:
            await rig.send(t)
        await rig.until(lambda: rig.worker.prefills.waiting == len(tasks), "every task at the prefill loop")
    ready = {}
    for _ in tasks:
        msg = await rig.next_inbox()
        assert isinstance(msg, m.KvReady), msg
        ready[msg.request_id] = msg
    if max_prompts == 1:
        assert len(forwards) == len(tasks) and max(forwards) == 1, forwards
    else:
        assert len(forwards) < len(tasks) and max(forwards) > 1, forwards
    for t in tasks:
        first, rows = reference_prefill(reference, list(t.prompt_ids))
        assert ready[t.request_id].first_token.token_id == first
        same_kv(rig.decode.rows(list(t.handle.page_ids), len(t.prompt_ids)), rows)
    await rig.settled()
    assert rig.first_tokens() == {rid: [r.first_token.token_id, 0] for rid, r in ready.items()}


async def test_the_heartbeat_reports_queued_prompts_and_their_tokens(make_rig) -> None:
    """Tasks queued behind a busy engine thread show in the heartbeat as waiting prompts and tokens (what
    the scheduler weighs prefill workers by); once done, nothing waits."""
    rig: Rig = await make_rig()
    beats: asyncio.Queue[m.WorkerHeartbeat] = asyncio.Queue()

    async def on_beat(msg: m.Heartbeat) -> None:
        if isinstance(msg, m.WorkerHeartbeat) and msg.worker_id == rig.worker.instance_id:
            await beats.put(msg)

    await rig.bus.subscribe(subjects.heartbeat("prefill"), m.Heartbeat, on_beat)
    await rig.bus.flush()
    tasks = [rig.task(PROMPT[:n], [2 * k, 2 * k + 1]) for k, n in enumerate((30, 17, 25))]
    async with engine_held(rig.worker.et):  # engine calls made in the block queue behind it
        for t in tasks:
            await rig.send(t)
        await rig.until(lambda: rig.worker.prefills.waiting == len(tasks), "every task at the prefill loop")
        await rig.worker.heartbeat.beat()
        hb = await asyncio.wait_for(beats.get(), 10)
    # queued behind the held thread, or taken into the round that waits for it: not yet computed either way
    assert (hb.waiting_tokens, hb.running + hb.waiting) == (30 + 17 + 25, 3), hb
    assert hb.max_running == rig.worker.engine.batcher.max_num_seqs  # the engine's batch size
    for _ in tasks:
        assert isinstance(await rig.next_inbox(), m.KvReady)
    await rig.settled()
    await rig.worker.heartbeat.beat()
    hb = await asyncio.wait_for(beats.get(), 10)
    assert (hb.running, hb.waiting, hb.waiting_tokens) == (0, 0, 0), hb
