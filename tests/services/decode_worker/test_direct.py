"""The decode worker's direct path (DecodeDirect: a short prompt prefilled on the decode worker) against a
real nats-server and the tiny model: prompts join the next step's engine-thread call, each streams the
tokens an in-process Engine gives, a prompt the engine refuses fails alone, and a cancel before the step
leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from proto import messages as m
from proto import subjects
from services.decode_worker.service import DecodeWorker, DecodeWorkerSettings
from services.decode_worker.streams import Live
from tests.service_helpers import engine_held, start_service, stop_service

STREAM = subjects.stream("gw-direct-t")
TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)


def greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    engine = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return list(engine.generate([prompt], params)[0].token_ids)


class Rig:
    def __init__(self, bus: Bus, worker: DecodeWorker) -> None:
        self.bus, self.worker = bus, worker
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.errors: dict[str, m.RequestError] = {}

    async def on_stream(self, msg: m.StreamMessage) -> None:
        match msg:
            case m.TokenBatch(deltas=deltas):
                for d in deltas:
                    self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
                    if d.finish != m.FinishReason.NONE:
                        self.finished.add(d.request_id)
            case m.RequestError():
                self.errors[msg.request_id] = msg

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        """Polled: the conditions change on the worker's own tasks and threads as well as on the stream."""
        try:
            async with asyncio.timeout(60):
                while not cond():
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None

    async def direct(self, rid: str, prompt: list[int]) -> None:
        sampling = m.Sampling(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        msg = m.DecodeDirect(request_id=rid, prompt_ids=prompt, sampling=sampling, stream_subject=STREAM)
        await self.bus.publish(subjects.decode_inbox(self.worker.instance_id), msg)


@contextlib.asynccontextmanager
async def running_rig(nats_url: str, model_dir: Path, **settings: object) -> AsyncIterator[Rig]:
    """A decode worker on the tiny model (a fake kv-broker that says yes), and the test's stream."""
    bus = await Bus.connect(nats_url, "decode-direct-test")

    async def on_broker(msg: m.BrokerRequest) -> m.BrokerReply:
        return m.BrokerReply(ok=True)

    await bus.subscribe(subjects.BROKER, m.BrokerRequest, on_broker, concurrent=True)
    worker = DecodeWorker(
        DecodeWorkerSettings(
            nats_url=nats_url,
            instance_id=f"decode-{uuid.uuid4().hex[:8]}",
            model_dir=str(model_dir),
            transfer_protocol="inprocess",
            heartbeat_interval_ms=60_000,
            enable_prefix_cache=False,
            **settings,
        )  # fmt: skip
    )
    task = await start_service(worker, timeout=120)
    r = Rig(bus, worker)
    await bus.subscribe(STREAM, m.StreamMessage, r.on_stream)
    await bus.flush()
    try:
        yield r
    finally:
        await stop_service(worker, task, timeout=30)
        await bus.close()


@pytest.fixture
async def rig(private_nats_url: str, model_dir: Path) -> AsyncIterator[Rig]:
    async with running_rig(private_nats_url, model_dir) as r:
        yield r


async def test_prompts_that_arrive_during_a_step_join_the_next_and_a_refused_one_fails_alone(
    rig: Rig, model_dir: Path
) -> None:
    a, b = [5, 9, 13, 17, 21], [7, 3, 11]
    too_long = list(range(3, 3 + 5000))  # past the model's 4,096 positions: the engine refuses it
    async with engine_held(rig.worker.et):  # engine calls made in the block queue behind it
        for rid, prompt in (("a", a), ("long", too_long), ("b", b)):
            await rig.direct(rid, prompt)
        await rig.bus.flush()
        await rig.until(lambda: {"a", "long", "b"} <= set(rig.worker.live), "the three prompts taken in")
    await rig.until(lambda: {"a", "b"} <= rig.finished and "long" in rig.errors, "both streams and the error")
    assert rig.errors["long"].code == 400 and "long" not in rig.tokens
    assert rig.tokens["a"] == greedy(model_dir, a) and rig.tokens["b"] == greedy(model_dir, b)
    await rig.until(lambda: not rig.worker.live, "no request left")
    assert rig.worker.engine.stats()["used_pages"] == 0


async def test_an_idle_worker_hands_a_direct_prompt_to_the_engine_thread_from_the_handler(
    rig: Rig, model_dir: Path
) -> None:
    """The step starts while the event loop is held right after the inbox handler returns: the handler
    queued it on the engine thread itself (a step loop woken through the event loop would not start it)."""
    worker = rig.worker
    step_once, started = worker._step_once, threading.Event()

    def step(adds: list) -> tuple:
        if adds:
            started.set()
        return step_once(adds)

    worker._step_once = step  # type: ignore[method-assign]
    await rig.until(lambda: worker.pacing.idle, "the step loop to wait for work")
    prompt = [5, 9, 13, 17, 21]
    sampling = m.Sampling(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    await worker.on_inbox(
        m.DecodeDirect(request_id="now", prompt_ids=prompt, sampling=sampling, stream_subject=STREAM)
    )
    assert started.wait(10), "the engine thread did not start the step while the event loop was held"
    await rig.until(lambda: "now" in rig.finished, "the stream to finish")
    assert rig.tokens["now"] == greedy(model_dir, prompt)
    await rig.until(lambda: not worker.live, "no request left")
    assert worker.engine.stats()["used_pages"] == 0


async def test_a_kicked_step_that_finishes_its_request_is_the_only_step(rig: Rig, model_dir: Path) -> None:
    """A one-token prompt on an idle worker takes one engine-thread call: the kick's wake-up is the kicked
    step's own, so the loop goes back to waiting without an empty step after it (which would cost a thread
    round trip and count twice in moemesh_decode_step_seconds)."""
    worker = rig.worker
    step_once, calls = worker._step_once, []

    def step(adds: list) -> tuple:
        calls.append(len(adds))
        return step_once(adds)

    worker._step_once = step  # type: ignore[method-assign]
    prompt = [5, 9, 13, 17, 21]
    for i in range(3):  # sequential, as a benchmark's one-at-a-time requests
        await rig.until(lambda: worker.pacing.idle, "the loop idle")
        sampling = m.Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
        msg = m.DecodeDirect(
            request_id=f"one-{i}", prompt_ids=prompt, sampling=sampling, stream_subject=STREAM
        )
        await worker.on_inbox(msg)
        await rig.until(lambda i=i: f"one-{i}" in rig.finished, "the stream to finish")
    await rig.until(lambda: worker.pacing.idle, "the loop idle")
    assert calls == [1, 1, 1]
    assert all(rig.tokens[f"one-{i}"] == greedy(model_dir, prompt)[:1] for i in range(3))


async def test_an_idle_workers_kicked_step_runs_on_the_event_loop_and_a_busy_ones_on_the_engine_thread(
    rig: Rig, model_dir: Path
) -> None:
    """inline_step_max_tokens: the engine thread idle, the direct prompt's step runs in the inbox handler's
    own thread (no hand-off before the first token); with an engine call in flight, or a prompt past the
    bound, it is queued for the engine thread."""
    worker = rig.worker
    step_once, threads = worker._step_once, []

    def step(adds: list) -> tuple:
        threads.append(threading.current_thread())
        return step_once(adds)

    worker._step_once = step  # type: ignore[method-assign]
    prompt, one = [5, 9, 13, 17, 21], m.Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
    await rig.until(lambda: worker.pacing.idle, "the loop idle")
    await worker.on_inbox(
        m.DecodeDirect(request_id="idle", prompt_ids=prompt, sampling=one, stream_subject=STREAM)
    )
    assert threads == [threading.current_thread()]  # done before the handler returned, on this thread
    await rig.until(lambda: "idle" in rig.finished, "the first stream to finish")
    await rig.until(lambda: worker.pacing.idle, "the loop idle")
    async with engine_held(worker.et):
        msg = m.DecodeDirect(request_id="busy", prompt_ids=prompt, sampling=one, stream_subject=STREAM)
        await worker.on_inbox(msg)
        assert len(threads) == 1  # queued behind the held call
    await rig.until(lambda: "busy" in rig.finished, "the second stream to finish")
    assert len(threads) == 2 and threads[1] is not threading.current_thread()
    await rig.until(lambda: worker.pacing.idle, "the loop idle")
    long = [(3 * i) % 900 + 2 for i in range(worker.settings.inline_step_max_tokens + 1)]
    await worker.on_inbox(
        m.DecodeDirect(request_id="long", prompt_ids=long, sampling=one, stream_subject=STREAM)
    )
    await rig.until(lambda: "long" in rig.finished, "the long prompt's stream to finish")
    assert len(threads) == 3 and threads[2] is not threading.current_thread()
    assert rig.tokens["idle"] == rig.tokens["busy"] == greedy(model_dir, prompt)[:1]


async def test_a_cancel_before_the_step_leaves_no_request_and_no_page(rig: Rig) -> None:
    async with engine_held(rig.worker.et):  # engine calls made in the block queue behind it
        await rig.direct("kept", [42, 7])
        await rig.until(lambda: "kept" in rig.worker.live and not rig.worker.direct, "a step call holding it")
        await rig.direct("gone", [4, 8, 15, 16, 23])  # queued for the next call (the engine is held)
        await rig.until(lambda: [a[0] for a in rig.worker.direct] == ["gone"], "the second prompt queued")
        await rig.bus.publish(subjects.CANCEL, m.Cancel(request_id="gone", reason="client gone"))
        await rig.bus.flush()
        await rig.until(lambda: "gone" not in rig.worker.live, "the cancel")
        assert rig.worker.direct == []  # out of the queue before it reached the engine
    await rig.until(lambda: "kept" in rig.finished, "the other request to finish")
    assert "gone" not in rig.tokens and "gone" not in rig.errors
    await rig.until(lambda: not rig.worker.live, "no request left")
    assert rig.worker.engine.stats()["used_pages"] == 0 and rig.worker.engine.stats()["running"] == 0


async def test_with_overlap_publish_the_next_step_runs_while_the_last_ones_tokens_are_published(
    private_nats_url: str, model_dir: Path
) -> None:
    """Each publish of tokens that are not the last waits until the engine thread has started the next
    step: the loop must start step N+1 before it publishes step N (a loop that publishes first would
    wait here for a step it has not started). The stream is still the Engine's, in order."""
    async with running_rig(private_nats_url, model_dir, overlap_publish=True) as rig:
        worker, loop = rig.worker, asyncio.get_running_loop()
        step_once, publish = worker._step_once, worker._publish
        started: list[int] = []
        waits_failed: list[int] = []
        moved = asyncio.Event()

        def step(adds: list) -> tuple:
            started.append(len(started))
            loop.call_soon_threadsafe(moved.set)
            return step_once(adds)

        published = [0]

        async def publish_after_next_step(outputs: list) -> None:
            # these are step i's outputs (publishes go in step order): wait for step i+1 to start
            want = published[0] + 2
            published[0] += 1
            if outputs and not all(o.finished for o in outputs):
                try:
                    async with asyncio.timeout(10):
                        while len(started) < want:
                            moved.clear()
                            await moved.wait()
                except TimeoutError:
                    waits_failed.append(want)
            await publish(outputs)

        worker._step_once = step  # type: ignore[method-assign]
        worker._publish = publish_after_next_step  # type: ignore[method-assign]
        prompt = [5, 9, 13, 17, 21]
        await rig.direct("piped", prompt)
        await rig.until(lambda: "piped" in rig.finished, "the stream to finish")
        assert waits_failed == [], f"publishes that waited in vain for the next step: {waits_failed}"
        assert rig.tokens["piped"] == greedy(model_dir, prompt) and len(started) >= TOKENS


async def test_by_default_each_step_follows_the_last_ones_publish(
    private_nats_url: str, model_dir: Path
) -> None:
    """overlap_publish off (the default): every step after the first starts only once the step before it
    was published."""
    async with running_rig(private_nats_url, model_dir) as r:
        worker = r.worker
        events: list[str] = []  # "step" from the engine thread, "published" from the loop
        step_once, publish = worker._step_once, worker._publish

        def step(adds: list) -> tuple:
            events.append("step")
            return step_once(adds)

        async def published(outputs: list) -> None:
            await publish(outputs)
            events.append("published")

        worker._step_once = step  # type: ignore[method-assign]
        worker._publish = published  # type: ignore[method-assign]
        prompt = [5, 9, 13, 17, 21]
        await r.direct("serial", prompt)
        await r.until(lambda: "serial" in r.finished, "the stream to finish")
        assert r.tokens["serial"] == greedy(model_dir, prompt)
        assert len(events) >= 2 * TOKENS and events == ["step", "published"] * (len(events) // 2), events


async def test_the_worker_sets_its_gil_switch_interval(private_nats_url: str, model_dir: Path) -> None:
    """The engine thread's host work must not hold the event loop off for Python's default 5 ms per GIL
    hand-back: the worker process runs with its setting (default 0.5 ms)."""
    before = sys.getswitchinterval()
    try:
        async with running_rig(private_nats_url, model_dir, gil_switch_interval_ms=0.7):
            assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)
    assert DecodeWorkerSettings(model_dir=str(model_dir)).gil_switch_interval_ms == 0.5


async def test_a_request_that_joins_while_the_last_step_runs_is_stepped(
    private_nats_url: str, model_dir: Path
) -> None:
    """The lost wake-up behind a flaky e2e test: a request joins (added on the engine thread, then the step
    loop woken, as KvReady does) while the only running request's last step runs. That step said "nothing
    more"; a loop that then cleared its wake-up left the new request waiting until some other request came.
    (The step runs on the engine thread: inline, the idle worker's first step would hold the event loop.)"""
    async with running_rig(private_nats_url, model_dir, inline_step_max_tokens=0) as rig:
        await _joins_while_the_last_step_runs(rig, model_dir)


async def _joins_while_the_last_step_runs(rig: Rig, model_dir: Path) -> None:
    worker = rig.worker
    step_once, publish = worker._step_once, worker._publish
    running, release, publish_held = threading.Event(), threading.Event(), asyncio.Event()

    def step(adds: list) -> tuple:
        if adds:  # the step of "alone", the worker's only request
            running.set()
            assert release.wait(30)
        return step_once(adds)

    async def held_publish(outputs: list) -> None:
        await publish_held.wait()  # the loop's end of step comes after the join below
        await publish(outputs)

    worker._step_once = step  # type: ignore[method-assign]
    worker._publish = held_publish  # type: ignore[method-assign]
    one = m.Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
    await worker.on_inbox(
        m.DecodeDirect(request_id="alone", prompt_ids=[5, 9, 13], sampling=one, stream_subject=STREAM)
    )
    assert await asyncio.to_thread(running.wait, 30)
    prompt = [7, 3, 11, 2]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    async def join() -> None:  # queued on the engine thread behind the running step, as KvReady's add is
        await worker.et.call(worker.engine.add_request, "joined", prompt, params)
        worker.live["joined"] = Live(STREAM, len(prompt))
        worker._wake()

    joining = asyncio.create_task(join())
    release.set()
    await joining
    publish_held.set()
    await rig.until(lambda: {"alone", "joined"} <= rig.finished, "both streams to finish")
    assert rig.tokens["joined"] == greedy(model_dir, prompt)


async def test_a_failed_publish_leaves_the_step_loop_running(rig: Rig, model_dir: Path) -> None:
    """A step's tokens that cannot be published (the bus went away under the publish) are logged; the loop
    steps on, so the next requests stream (a raise here once ended the loop and the worker served nothing)."""
    worker, publish, failed = rig.worker, rig.worker._publish, []

    async def flaky(outputs: list) -> None:
        if outputs and not failed:
            failed.append(outputs)
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
        await publish(outputs)

    worker._publish = flaky  # type: ignore[method-assign]
    await rig.direct("lost", [5, 9, 13])
    await rig.until(lambda: bool(failed), "the failed publish")
    prompt = [7, 3, 11, 2]
    await rig.direct("after", prompt)
    await rig.until(lambda: "after" in rig.finished, "the next request streamed")
    assert rig.tokens["after"] == greedy(model_dir, prompt) and not worker.loop_task.done()
    assert not worker.stopping.is_set()


async def test_a_step_loop_that_ends_stops_the_worker_with_exit_code_1(rig: Rig) -> None:
    """Nothing steps without the loop: if it ends before the drain the worker stops (a supervisor restarts
    it) rather than staying up, heartbeating, with requests that never advance."""
    worker = rig.worker

    def broken(inline: bool = False) -> tuple:
        raise AssertionError("pacing bug")  # outside the step's own error handling: ends the loop

    worker._start_step = broken  # type: ignore[method-assign]
    await rig.direct("x", [5, 9, 13])
    await rig.until(lambda: worker.stopping.is_set(), "the worker stopping")
    assert worker.exit_code == 1 and worker.loop_task.done()
