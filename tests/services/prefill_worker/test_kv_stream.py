"""Per-chunk KV transfer overlap: a long prompt's finished pages travel (real Mooncake TCP on loopback)
while its later chunks compute, and the decode side ends with exactly the bytes of a transfer made after
the whole prompt; the stream's bookkeeping (`pages_due`, re-sends after a preemption, a failing write)."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
import torch

from libs.kvtransfer.base import TransferError
from proto import messages as m
from services.prefill_worker.kv_stream import KvStream, pages_due
from tests.services.prefill_worker.conftest import Rig
from tests.services.prefill_worker.test_service import reference_prefill, same_kv

CHUNK = 32  # max_prefill_tokens: the 160-token prompt runs in five chunks (two 16-token pages each)
LONG = [(5 * i + 11) % 900 + 3 for i in range(160)]
DST = [3, 4, 5, 11, 12, 13, 14, 0, 1, 2]  # ten pages, three runs


def test_pages_due_skips_what_landed_and_what_the_decode_side_caches() -> None:
    assert pages_due([7, 8, 9], {}, 0) == [0, 1, 2]
    assert pages_due([7, 8, 9], {0: 7, 1: 8}, 0) == [2]
    assert pages_due([7, 8, 9], {0: 7, 1: 5}, 0) == [1, 2]  # index 1 now lives in another source page
    assert pages_due([7, 8, 9], {}, 2) == [2]
    assert pages_due([], {0: 7}, 0) == []


async def test_a_preemption_resends_every_page_and_a_write_in_flight_does_not_count() -> None:
    """[] (preempted) while a write is in flight: that write's pages are sent again once final again."""
    writes: list[tuple[list[int], list[int]]] = []
    gate = threading.Event()

    def write(src: list[int], dst: list[int]) -> tuple[int, int]:
        writes.append((src, dst))
        assert gate.wait(10)
        return len(src), 1

    s = KvStream(write, [50, 51, 52, 53], 0, lambda: None, lambda e: pytest.fail(f"unexpected {e}"))
    s.update([7, 8], None)
    while not writes:  # the first write started on its thread
        await asyncio.sleep(0)
    s.update([], None)  # preempted while it is in flight
    s.update([7, 8], None)  # recomputed into the same pages: still sent again
    gate.set()
    assert await s.finish([7, 8, 9, 10]) == 2
    assert writes == [([7, 8], [50, 51]), ([7, 8], [50, 51]), ([9, 10], [52, 53])]
    assert (s.bytes, s.early_bytes) == (6, 4)


async def test_a_failing_write_fails_the_prompt_and_stops_the_stream() -> None:
    errors: list[BaseException] = []

    def write(src: list[int], dst: list[int]) -> tuple[int, int]:
        raise TransferError("connection reset by peer")

    s = KvStream(write, [50, 51, 52], 0, lambda: None, errors.append)
    s.update([7], None)
    with pytest.raises(TransferError):
        await s.finish([7, 8, 9])  # waits for the early write, then reports its failure
    assert [str(e) for e in errors] == ["connection reset by peer"]
    s.update([7, 8], None)  # ignored after the failure
    await s.close()
    assert s.bytes == 0


async def _run_long_prompt(rig: Rig, hold_s: float) -> tuple[m.KvReady, list[tuple], torch.Tensor]:
    """LONG through the worker with the step that runs its last chunk held until a KV write has landed
    (or hold_s). Returns KvReady, the ordered events and the prompt's rows in the worker's own pool when
    its pages were released (what a transfer made after the whole prompt would copy)."""
    engine, transport = rig.worker.engine, rig.worker.transport
    task = rig.task(LONG, DST)
    rid = task.request_id
    events: list[tuple] = []
    landed = threading.Event()
    released: dict[str, torch.Tensor] = {}
    real_step, real_write, real_release = engine.step, transport.write, engine.release

    def step():  # the engine thread
        req = engine.requests.get(rid)
        if req is not None and req.num_computed + CHUNK >= len(LONG) and req.num_computed > 0:
            events.append(("last chunk", req.num_computed, landed.wait(hold_s)))
        return real_step()

    def write(session, runs):  # a transfer thread
        req = engine.requests.get(rid)
        nbytes = real_write(session, runs)
        events.append(("write", nbytes, req.num_computed if req is not None else len(LONG)))
        landed.set()
        return nbytes

    def release(r: str) -> bool:  # the engine thread, after KvReady: the source pages as they ended
        if r in engine.pinned:
            pages = engine.pinned[r].pages
            idx = torch.cat([torch.arange(p * engine.page_size, (p + 1) * engine.page_size) for p in pages])
            released[r] = engine.kv_pool.buffer[:, idx[: len(LONG)]].clone()
        return real_release(r)

    engine.step, transport.write, engine.release = step, write, release  # type: ignore[method-assign]
    await rig.send(task)
    ready = await rig.next_inbox()
    assert isinstance(ready, m.KvReady), ready
    await rig.settled()
    return ready, events, released[rid]


async def test_early_chunks_land_before_the_last_chunk_runs_and_the_kv_equals_a_whole_transfer(
    make_rig, reference
) -> None:
    rig: Rig = await make_rig(mooncake=True, max_prefill_tokens=CHUNK)
    ready, events, source = await _run_long_prompt(rig, hold_s=20)
    first_write = next(i for i, e in enumerate(events) if e[0] == "write")
    last_chunk = next(i for i, e in enumerate(events) if e[0] == "last chunk")
    assert first_write < last_chunk and events[last_chunk][2], events  # landed, the gate did not time out
    assert events[first_write][1] > 0 and events[first_write][2] < len(LONG)  # while the prompt computed
    early = rig.worker.registry.get_sample_value("moemesh_kv_transfer_early_bytes_total")
    total = rig.worker.registry.get_sample_value("moemesh_kv_transfer_bytes_total")
    assert early is not None and total is not None and 0 < early < total
    got = rig.decode.rows(DST, len(LONG)).clone()
    assert torch.equal(got, source)  # bit for bit what the finished prompt held
    first, rows = reference_prefill(reference, LONG)
    assert ready.first_token.token_id == first
    same_kv(got, rows)

    # The baseline (stream_kv off) sends the whole prompt after its last chunk: the same bytes land.
    # One worker for both (two rigs would answer each other's broker lookups): the prompt is computed
    # afresh (prefix cache flushed) into a zeroed decode pool.
    rig.worker.settings = msgspec.structs.replace(rig.worker.settings, stream_kv=False)
    await rig.worker.et.call(rig.worker.engine.flush_prefix_cache)
    rig.decode.buffer.zero_()
    ready_whole, events_whole, source_whole = await _run_long_prompt(rig, hold_s=0)
    assert [e[0] for e in events_whole][0] == "last chunk" and not events_whole[0][2]  # nothing landed early
    assert rig.worker.registry.get_sample_value("moemesh_kv_transfer_early_bytes_total") == early
    assert ready_whole.first_token.token_id == first
    assert torch.equal(source_whole, source)  # the prompt computed the same rows again
    assert torch.equal(rig.decode.rows(DST, len(LONG)), got)


async def test_an_early_write_that_fails_fails_the_task_before_its_last_chunk(make_rig) -> None:
    rig: Rig = await make_rig(max_prefill_tokens=CHUNK)
    calls: list[int] = []

    def fail(session, runs):
        calls.append(len(runs))
        raise TransferError("connection reset by peer")

    rig.worker.transport.write = fail  # type: ignore[method-assign]
    task = rig.task(LONG, DST)
    await rig.send(task)
    failed = await rig.next_inbox()
    assert isinstance(failed, m.PrefillFailed) and "connection reset" in failed.message
    assert len(calls) == 1  # the first early write; nothing after it
    await rig.settled()
    engine = rig.worker.engine
    await rig.until(lambda: not engine.has_unfinished(), "the prompt aborted mid-way")  # by the next round
    await rig.worker.et.call(engine.flush_prefix_cache)
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]
