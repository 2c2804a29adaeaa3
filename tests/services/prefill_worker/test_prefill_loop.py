"""PrefillLoop's inline rounds on the tiny model in this process: with the engine thread idle, a short
prompt's round runs on the event loop's own thread (no hand-off before its first token); with an engine
call in flight, or more tokens than the bound, it goes to the engine thread; either way the first token is
the in-process Engine's (greedy)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.engine import Engine
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.worker.engine_thread import EngineThread
from services.prefill_worker.prefill_loop import PrefillLoop
from tests.service_helpers import engine_held

BOUND = 32
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)


def first_tokens(model_dir: Path, prompts: list[list[int]]) -> list[int]:
    ref, got = Engine.from_pretrained(model_dir), []
    for i, prompt in enumerate(prompts):
        ref.add_request(f"ref{i}", prompt, GREEDY)
        while ref.has_unfinished():
            got += [o.token_ids[0] for o in ref.step() if o.token_ids]
    return got


@pytest.fixture
async def rig(model_dir: Path) -> AsyncIterator[tuple[PrefillLoop, EngineThread, list[threading.Thread]]]:
    engine = Engine.from_pretrained(model_dir)
    et = EngineThread(engine)
    loop = PrefillLoop(engine, et, inline_max_tokens=BOUND)
    threads: list[threading.Thread] = []
    step = engine.step

    def traced_step():  # which thread ran each forward
        threads.append(threading.current_thread())
        return step()

    engine.step = traced_step  # type: ignore[method-assign]
    loop.start()
    try:
        yield loop, et, threads
    finally:
        await loop.stop()
        et.shutdown()


async def test_an_idle_workers_short_prompt_prefills_on_the_event_loop(rig, model_dir: Path) -> None:
    loop, et, threads = rig
    prompts = [[(7 * i + k) % 900 + 3 for k in range(n)] for i, n in enumerate((20, BOUND + 1, 12))]
    res = await loop.prefill("a", prompts[0], GREEDY)
    assert threads == [threading.current_thread()] and loop.inline_rounds == 1
    await loop.release("a")
    res_long = await loop.prefill("b", prompts[1], GREEDY)  # past the bound: the engine thread's
    assert len(threads) == 2 and threads[1] is not threading.current_thread() and loop.inline_rounds == 1
    await loop.release("b")
    async with engine_held(et):  # an engine call in flight: queued behind it, not run beside it
        task = asyncio.create_task(loop.prefill("c", prompts[2], GREEDY))
        async with asyncio.timeout(10):
            while et._queued < 2:  # the held call and the round queued behind it
                await asyncio.sleep(0.001)
        assert len(threads) == 2  # nothing ran beside the held call
    res_busy = await task
    assert len(threads) == 3 and threads[2] is not threading.current_thread() and loop.inline_rounds == 1
    await loop.release("c")
    got = [res.first_token, res_long.first_token, res_busy.first_token]
    assert got == first_tokens(model_dir, prompts)


async def test_each_step_reports_its_prompts_and_the_engine_steps_time(model_dir: Path) -> None:
    engine = Engine.from_pretrained(model_dir)
    et = EngineThread(engine)
    seen: list[tuple[int, float]] = []
    loop = PrefillLoop(engine, et, lambda n, s: seen.append((n, s)), inline_max_tokens=BOUND)
    step = engine.step

    def slow_step():  # a step of known least duration
        time.sleep(0.05)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    loop.start()
    try:
        await loop.prefill("a", [5, 6, 7, 8], GREEDY)
        await loop.release("a")
    finally:
        await loop.stop()
        et.shutdown()
    assert len(seen) == 1 and seen[0][0] == 1
    assert 0.05 <= seen[0][1] < 10
