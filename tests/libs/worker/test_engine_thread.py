"""EngineThread: calls serialized on one thread, and run_inline's shortcut only when that thread is idle."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from libs.worker.engine_thread import EngineCallsCollector, EngineThread


def _until(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


@pytest.fixture
def et() -> Any:
    t = EngineThread(engine=None)  # type: ignore[arg-type]  # the calls here do not touch an engine
    yield t
    t.shutdown()


async def test_an_idle_engine_thread_lets_the_caller_run_the_call_and_after_call_follows(
    et: EngineThread,
) -> None:
    after: list[str] = []
    et.after_call = lambda: after.append("after")
    fut = et.run_inline(lambda x: (threading.current_thread(), x), 7)
    assert fut is not None and fut.done()
    assert fut.result() == (threading.current_thread(), 7) and after == ["after"]
    failed = et.run_inline(lambda: 1 / 0)
    assert failed is not None and isinstance(failed.exception(), ZeroDivisionError)
    assert after == ["after", "after"]
    assert await et.call(threading.current_thread) is not threading.current_thread()  # the engine thread


async def test_a_queued_call_keeps_the_caller_out_and_runs_first(et: EngineThread) -> None:
    hold, order = threading.Event(), []
    first = et.submit(lambda: (hold.wait(30), order.append("queued")))
    assert et.run_inline(order.append, "inline") is None  # the engine thread has work: submit instead
    second = et.submit(order.append, "submitted")
    hold.set()
    await first
    await second
    assert order == ["queued", "submitted"]
    assert et.run_inline(order.append, "inline") is not None and order[-1] == "inline"  # idle again


async def test_a_transfer_threads_call_waits_for_the_inline_one(et: EngineThread) -> None:
    """run_blocking from another thread while the caller runs a call inline: the engine thread takes it
    only once the inline call returned (one lock around both)."""
    order: list[str] = []
    other = threading.Thread(target=lambda: et.run_blocking(order.append, "transfer"))

    def inline() -> None:
        other.start()
        _until(lambda: et._queued == 1, "the transfer thread's call queued")
        order.append("inline")

    assert et.run_inline(inline) is not None
    other.join(30)
    assert order == ["inline", "transfer"]


async def test_the_calls_counted_by_where_they_ran_reach_the_metrics(et: EngineThread) -> None:
    registry = CollectorRegistry()
    registry.register(EngineCallsCollector(et))

    def calls(on: str) -> float | None:
        return registry.get_sample_value("moemesh_worker_engine_calls_total", {"on": on})

    assert (calls("loop"), calls("thread")) == (0, 0)
    assert et.run_inline(lambda: None) is not None
    hold = threading.Event()
    busy = et.submit(hold.wait, 30)
    assert et.run_inline(lambda: None) is None  # refused: counted nowhere, the caller submits it
    queued = asyncio.ensure_future(et.call(lambda: None))  # runs on the thread once the hold is released
    hold.set()
    await busy
    await queued
    assert (calls("loop"), calls("thread")) == (1, 2)
