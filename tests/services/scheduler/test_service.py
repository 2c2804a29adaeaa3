"""The scheduler service against a real nats-server, with in-test decode and prefill worker doubles."""

# Every test uses its own model name, worker ids and stream subject, so nothing seen on the shared server
# can be placed on by mistake. Waits are on conditions (queues, the service's change notifications) with
# timeouts, never on sleeps.

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

import proto
from libs.bus import Bus, load_settings, new_traceparent, request_context
from libs.bus.settings import SettingsError
from proto import messages as m
from proto import subjects
from services.scheduler.service import SchedulerService, SchedulerSettings
from tests.services.scheduler.doubles import FakeDecode, FakePrefill
from tests.services.scheduler.factories import make_submit

TIMEOUT = 5.0
DEFAULTS = dict(
    direct_prefill_threshold=32, max_queue=8, reserve_timeout_s=1.0, max_retries=1, queue_timeout_s=10.0
)


@dataclass
class Harness:
    svc: SchedulerService
    bus: Bus
    model: str
    stream: str
    errors: asyncio.Queue[m.RequestError]

    def wid(self, name: str) -> str:
        return f"{name}-{self.model}"

    async def until(self, pred: Callable[[], bool]) -> None:
        async with asyncio.timeout(TIMEOUT):
            while not pred():
                await self.svc.next_change()

    async def decode(self, name: str, refuse: bool = False, **hb: object) -> FakeDecode:
        w = await FakeDecode(self.bus, self.wid(name), self.model, refuse=refuse).start(**hb)
        await self.until(lambda: w.worker_id in self.svc.workers)
        return w

    async def prefill(self, name: str, **hb: object) -> FakePrefill:
        w = await FakePrefill(self.bus, self.wid(name), self.model).start(**hb)
        await self.until(lambda: w.worker_id in self.svc.workers)
        return w

    async def submit(self, rid: str, prompt_len: int = 100, max_tokens: int = 4) -> m.SubmitReply:
        s = make_submit(rid, prompt_len, max_tokens, stream=self.stream)
        s = m.Submit(
            request_id=s.request_id, model=self.model, prompt_ids=s.prompt_ids, sampling=s.sampling,
            stream_subject=s.stream_subject,
        )  # fmt: skip
        return await self.bus.request(subjects.SCHED_SUBMIT, s, m.SubmitReply, timeout=TIMEOUT)

    def metric(self, name: str, **labels: str) -> float:
        return self.svc.registry.get_sample_value(name, labels) or 0.0


async def _get(q: asyncio.Queue):  # type: ignore[type-arg]
    return await asyncio.wait_for(q.get(), TIMEOUT)


@pytest.fixture
async def start(nats_server: str) -> AsyncIterator[Callable[..., object]]:
    client = await Bus.connect(nats_server, "scheduler-test")
    running: list[tuple[SchedulerService, asyncio.Task]] = []

    async def _start(**overrides: object) -> Harness:
        settings = SchedulerSettings(nats_url=nats_server, **{**DEFAULTS, **overrides})  # type: ignore[arg-type]
        svc = SchedulerService(settings, CollectorRegistry())
        task = asyncio.create_task(svc.run(install_signals=False))
        running.append((svc, task))
        ready = asyncio.create_task(svc.started.wait())
        await asyncio.wait({ready, task}, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raise the startup error
        assert svc.started.is_set(), "scheduler did not start"
        model = f"m{uuid.uuid4().hex[:8]}"
        errors: asyncio.Queue[m.RequestError] = asyncio.Queue()

        async def on_stream(msg: m.StreamMessage) -> None:
            if isinstance(msg, m.RequestError):
                await errors.put(msg)

        stream = subjects.stream(model)
        await client.subscribe(stream, m.StreamMessage, on_stream)
        await client.flush()
        return Harness(svc, client, model, stream, errors)

    yield _start
    for svc, task in running:
        svc.request_stop()
        await asyncio.wait_for(task, TIMEOUT)
    await client.close()


async def test_long_prompt_is_reserved_on_decode_then_prefilled(start) -> None:
    h = await start()
    d, p = await h.decode("d0"), await h.prefill("p0")
    tp = new_traceparent()
    with request_context(traceparent=tp):
        reply = await h.submit("r1", prompt_len=100)
    assert reply == m.SubmitReply(request_id="r1", ok=True, scheduler_id=h.svc.instance_id)
    reserve = await _get(d.reserves)
    assert (reserve.request_id, reserve.num_tokens, reserve.lease_ms) == ("r1", 100, h.svc.settings.lease_ms)
    # the decode worker learns who writes the pages and whom to tell if that worker dies
    assert (reserve.stream_subject, reserve.prefill_worker) == (h.stream, p.worker_id)
    start_msg = await _get(p.inbox)  # overlap_prefill (the default): the prompt starts with the ReserveKv
    assert isinstance(start_msg, m.PrefillStart) and start_msg.prompt_ids == list(range(1, 101))
    task, task_tp = await _get(p.tasks)
    assert task.handle == d.handles["r1"] and task.prompt_ids == list(range(1, 101))
    assert task.stream_subject == h.stream and task_tp == tp  # the trace crosses the queue
    await h.until(lambda: h.metric("moemesh_scheduler_placements_total", kind="disaggregated") == 1)
    assert d.directs.empty() and h.svc.queue.depth == 0
    assert h.metric("moemesh_scheduler_placement_seconds_count") == 1


async def test_short_prompt_goes_straight_to_decode(start) -> None:
    h = await start(direct_prefill_threshold=32)
    d, p = await h.decode("d0"), await h.prefill("p0")
    assert (await h.submit("short", prompt_len=20)).ok
    direct = await _get(d.directs)
    assert (direct.request_id, len(direct.prompt_ids), direct.stream_subject) == ("short", 20, h.stream)
    await h.until(lambda: h.metric("moemesh_scheduler_placements_total", kind="direct") == 1)
    assert d.reserves.empty() and p.inbox.empty()


async def test_a_submit_with_nothing_queued_is_placed_by_its_own_handler(start) -> None:
    """The submit handler places a request that has nobody ahead of it: it reaches the decode worker even
    with the placement loop stopped (no pass of the loop on the TTFT path)."""
    h = await start(direct_prefill_threshold=32)
    d = await h.decode("d0")
    await h.prefill("p0")
    loop_task = h.svc._loop_task
    assert loop_task is not None
    loop_task.cancel()  # from here on only the submit handler can place
    with contextlib.suppress(asyncio.CancelledError):
        await loop_task
    assert (await h.submit("now", prompt_len=20)).ok
    assert (await _get(d.directs)).request_id == "now"
    assert h.svc.queue.depth == 0


async def test_sequential_requests_past_the_waiting_bound_are_placed_between_heartbeats(start) -> None:
    """One decode worker, heard once (its next heartbeat a minute away), takes more sequential requests
    than max_decode_waiting: those its batch has slots for are no line. Before the heartbeat carried the
    batch size, every placement since the heartbeat counted as waiting, so request 33 waited for the next
    heartbeat (up to 250 ms at the default interval: a TTFT outlier at any rate above 128 requests/s)."""
    h = await start(direct_prefill_threshold=32)
    assert h.svc.settings.max_decode_waiting == 32
    d = await h.decode("d0", max_running=64, free_pages=4096, total_pages=4096)
    for i in range(40):
        assert (await h.submit(f"r{i}", prompt_len=20)).ok
        assert (await _get(d.directs)).request_id == f"r{i}"
    assert h.svc.queue.depth == 0


@pytest.mark.parametrize("prompt_len", [20, 100], ids=["direct", "reservation"])
async def test_a_placement_made_by_the_submit_handler_leaves_before_its_reply(start, prompt_len: int) -> None:
    """The DecodeDirect (short prompt) or the ReserveKv (long one) is handed to the connection before the
    SubmitReply: the reply is off the TTFT path, the decode worker's message is on it."""
    h = await start(direct_prefill_threshold=32)
    d = await h.decode("d0")
    await h.prefill("p0")
    nc, sent = h.svc.bus.nc, []
    publish = nc.publish

    async def recording(subject: str, *args: object, **kwargs: object) -> None:
        sent.append(subject)
        await publish(subject, *args, **kwargs)  # type: ignore[arg-type]

    nc.publish = recording  # type: ignore[method-assign]
    try:
        assert (await h.submit("first", prompt_len=prompt_len)).ok
    finally:
        del nc.publish  # the class's method again
    kept = [s for s in sent if s == subjects.decode_inbox(d.worker_id) or s.startswith("_INBOX.")]
    assert kept[:1] == [subjects.decode_inbox(d.worker_id)] and len(kept) >= 2, sent


async def test_a_submit_behind_a_waiting_request_keeps_its_place(start) -> None:
    """FIFO: a small request that would fit does not pass a large one waiting for pages."""
    h = await start(direct_prefill_threshold=32)
    d = await h.decode("d0", free_pages=4)
    await h.prefill("p0")
    assert (await h.submit("big", prompt_len=100)).ok  # 7 pages: waits
    assert (await h.submit("small", prompt_len=20)).ok  # 2 pages would fit, but big is first
    assert h.svc.queue.depth == 2 and d.directs.empty() and d.reserves.empty()
    await d.heartbeat(free_pages=64)
    assert (await _get(d.reserves)).request_id == "big"
    assert (await _get(d.directs)).request_id == "small"


async def test_no_live_worker_is_503(start) -> None:
    h = await start()
    reply = await h.submit("r1")
    assert (reply.ok, reply.code) == (False, 503) and "decode" in reply.message
    assert h.metric("moemesh_scheduler_refusals_total", code="503") == 1
    d = await h.decode("d0")
    # long, but no prefill worker: prefilled on the decode worker itself rather than refused
    assert (await h.submit("r2", prompt_len=100)).ok
    direct = await _get(d.directs)
    assert (direct.request_id, len(direct.prompt_ids)) == ("r2", 100)


async def test_full_queue_is_429(start) -> None:
    h = await start(max_queue=2)
    await h.decode("d0", free_pages=0)  # no room: requests wait in the queue
    await h.prefill("p0")
    assert (await h.submit("a")).ok and (await h.submit("b")).ok
    reply = await h.submit("c")
    assert (reply.ok, reply.code, reply.message) == (False, 429, "queue full (2 requests)")
    assert h.metric("moemesh_scheduler_queue_depth") == 2


async def test_refused_reservation_is_retried_on_another_decode_worker(start) -> None:
    h = await start(max_retries=1)
    bad = await h.decode("d0", refuse=True)  # least loaded: tried first
    good = await h.decode("d1", running=3)
    p = await h.prefill("p0")
    assert (await h.submit("r1")).ok
    assert (await _get(bad.reserves)).request_id == "r1"
    assert (await _get(good.reserves)).request_id == "r1"
    task, _ = await _get(p.tasks)
    assert task.handle.decode_worker == good.worker_id
    inbox = [await _get(p.inbox) for _ in range(4)]  # overlap_prefill: the prompt starts once per attempt
    assert [type(x) for x in inbox] == [m.PrefillStart, m.PrefillAbandon, m.PrefillStart, m.PrefillTask]
    assert h.metric("moemesh_scheduler_retries_total") == 1


async def test_retries_used_up_end_the_stream_with_an_error(start) -> None:
    h = await start(max_retries=1)
    d = await h.decode("d0", refuse=True)
    await h.prefill("p0")
    assert (await h.submit("r1")).ok
    await _get(d.reserves)
    await h.until(lambda: h.svc.queue.depth == 1)  # back in line; d0 suspended until heard again
    await d.heartbeat()
    await _get(d.reserves)
    err = await _get(h.errors)
    assert (err.request_id, err.code) == ("r1", 503) and "2 attempts" in err.message
    assert "r1" not in h.svc.queue


async def test_cancel_drops_a_queued_request(start) -> None:
    h = await start()
    d = await h.decode("d0", free_pages=0)
    await h.prefill("p0")
    assert (await h.submit("gone")).ok and (await h.submit("kept")).ok
    await h.bus.publish(subjects.CANCEL, m.Cancel(request_id="gone", reason="client disconnected"))
    await h.until(lambda: "gone" not in h.svc.queue)
    await d.heartbeat(free_pages=64)  # room again: only the request still queued is placed
    assert (await _get(d.reserves)).request_id == "kept"
    assert d.reserves.empty()


async def test_request_not_placed_before_its_deadline_gets_504(start) -> None:
    h = await start(queue_timeout_s=0.2)
    await h.decode("d0", free_pages=0)
    await h.prefill("p0")
    assert (await h.submit("late")).ok
    err = await _get(h.errors)
    assert (err.request_id, err.code) == ("late", 504) and "free KV pages" in err.message


async def test_worker_gone_fails_queued_requests_with_503(start) -> None:
    h = await start()
    d = await h.decode("d0", free_pages=0)
    await h.prefill("p0")
    assert (await h.submit("r1")).ok
    await h.bus.publish(subjects.heartbeat("decode"), m.WorkerGone(worker_id=d.worker_id, role=m.Role.DECODE))
    err = await _get(h.errors)
    assert (err.request_id, err.code) == ("r1", 503)


async def test_garbage_is_rejected_and_the_service_keeps_serving(start) -> None:
    h = await start()
    rejected = proto.decoder(m.Rejected)
    garbage = await h.bus.nc.request(subjects.SCHED_SUBMIT, b"\xc1garbage", timeout=TIMEOUT)
    assert rejected.decode(garbage.data).code == 400
    wrong_type = proto.encode(m.Cancel(request_id="x"))
    wrong = await h.bus.nc.request(subjects.SCHED_SUBMIT, wrong_type, timeout=TIMEOUT)
    assert rejected.decode(wrong.data).code == 400
    await h.bus.nc.publish(subjects.heartbeat("decode"), b"not a heartbeat")
    await h.bus.nc.publish(subjects.CANCEL, b"\x00")
    d = await h.decode("d0")
    await h.prefill("p0")
    assert (await h.submit("after", prompt_len=10)).ok
    assert (await _get(d.directs)).request_id == "after"
    assert (
        h.metric("moemesh_bus_messages_total", subscription=subjects.SCHED_SUBMIT, outcome="undecodable") == 2
    )


async def test_bad_submit_is_400(start) -> None:
    h = await start()
    await h.decode("d0")
    s = m.Submit(request_id="e", model=h.model, prompt_ids=[], sampling=m.Sampling(), stream_subject=h.stream)
    reply = await h.bus.request(subjects.SCHED_SUBMIT, s, m.SubmitReply, timeout=TIMEOUT)
    assert (reply.ok, reply.code, reply.message) == (False, 400, "request 'e': empty prompt")


def test_settings_from_env_and_flags() -> None:
    s = load_settings(
        SchedulerSettings, "scheduler", ["--max-queue", "16"],
        env={"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "0", "MOEMESH_NATS_URL": "nats://h:1"},
    )  # fmt: skip
    assert (s.max_queue, s.direct_prefill_threshold, s.nats_url) == (16, 0, "nats://h:1")
    with pytest.raises(SettingsError, match="MOEMESH_SCHEDULER_MAX_QUEUEE"):
        load_settings(SchedulerSettings, "scheduler", env={"MOEMESH_SCHEDULER_MAX_QUEUEE": "1"})
    with pytest.raises(SettingsError, match="max_retries"):
        load_settings(SchedulerSettings, "scheduler", env={"MOEMESH_SCHEDULER_MAX_RETRIES": "-1"})


async def test_unanswered_reservation_is_retried_elsewhere(start) -> None:
    h = await start(max_retries=1)
    # a worker that heartbeats but whose inbox nobody serves (its process is wedged or gone)
    ghost = FakeDecode(h.bus, h.wid("ghost"), h.model)
    await ghost.heartbeat()
    await h.until(lambda: ghost.worker_id in h.svc.workers)
    good = await h.decode("d1", running=3)
    p = await h.prefill("p0")
    assert (await h.submit("r1")).ok
    task, _ = await _get(p.tasks)
    assert task.handle.decode_worker == good.worker_id
    inbox = [await _get(p.inbox) for _ in range(4)]  # overlap_prefill: the prompt starts once per attempt
    assert [type(x) for x in inbox] == [m.PrefillStart, m.PrefillAbandon, m.PrefillStart, m.PrefillTask]
    assert h.metric("moemesh_scheduler_retries_total") == 1


async def test_runs_as_a_module_and_stops_on_sigterm(nats_server: str) -> None:
    env = {**os.environ, "MOEMESH_NATS_URL": nats_server, "MOEMESH_SCHEDULER_MAX_QUEUE": "4"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.scheduler", "--direct-prefill-threshold", "8",
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(20):
            while b"ready" not in (line := await proc.stderr.readline()):
                assert line, "scheduler exited before it was ready"
        client = await Bus.connect(nats_server, "scheduler-module-test")
        s = make_submit("r1")
        reply = await client.request(subjects.SCHED_SUBMIT, s, m.SubmitReply, timeout=TIMEOUT)
        await client.close()
        assert (reply.ok, reply.code) == (False, 503)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), TIMEOUT) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_shutdown_fails_what_is_still_queued(start) -> None:
    h = await start()
    await h.decode("d0", free_pages=0)
    await h.prefill("p0")
    assert (await h.submit("r1")).ok
    h.svc.request_stop()
    err = await _get(h.errors)
    assert (err.request_id, err.code, err.message) == ("r1", 503, "scheduler is shutting down")
