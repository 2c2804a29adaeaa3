"""One thread owns the engine: every engine call from the asyncio side goes through `EngineThread.call`,
so calls are serialized (a reserve never races a step) while the event loop keeps serving the bus.
`run_inline` runs a call on the event loop itself when the engine thread is idle and nothing is queued."""

# The engine is synchronous torch code and not thread-safe. run_inline saves a lone request on an idle
# worker the two thread hand-offs before its first token, as SGLang's and vLLM's loops run the model in the
# thread that took the request. One lock around every call, on either thread, serializes them; a count of
# queued calls keeps their order.

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from libs.engine.protocol import EngineLike

T = TypeVar("T")


class EngineThread:
    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # run on the event loop after every call, failed ones too (KV cache events publish a step's batch)
        self.after_call: Callable[[], object] | None = None
        self._running = threading.Lock()  # held by whichever thread runs an engine call
        self._count = threading.Lock()
        self._queued = 0  # calls handed to the pool and not yet finished
        self.thread_calls = 0  # calls handed to the engine thread
        self.loop_calls = 0  # calls run_inline ran on the calling thread

    def _enqueue(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Callable[[], T]:
        with self._count:
            self._queued += 1
            self.thread_calls += 1

        def run() -> T:
            try:
                with self._running:
                    return fn(*args, **kwargs)
            finally:
                with self._count:
                    self._queued -= 1

        return run

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self._enqueue(fn, *args, **kwargs))
        finally:
            if self.after_call is not None:
                self.after_call()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`call` without the coroutine: fn is queued for the engine thread before this returns (a task that
        awaits `call` queues it only once the task first runs, a pass of the event loop later). The future
        gets the result; after_call runs when it is done."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._enqueue(fn, *args))
        if self.after_call is not None:
            after = self.after_call
            fut.add_done_callback(lambda _: after())
        return fut

    def run_inline(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T] | None:
        """fn run here and now, on the calling thread (the event loop), if the engine thread has nothing
        queued or running; its result (or exception) in a done future, after_call run. None when the engine
        thread is busy: then `submit` it."""
        with self._count:
            if self._queued or not self._running.acquire(blocking=False):
                return None
            self.loop_calls += 1
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:
            fut.set_exception(e)
        finally:
            self._running.release()
            if self.after_call is not None:
                self.after_call()
        return fut

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """fn on the engine thread, waited for by the calling thread (never the engine thread itself, nor
        the event loop: a transfer thread that must act where the engine's memory is)."""
        return self._pool.submit(self._enqueue(fn, *args)).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class EngineCallsCollector(Collector):
    """`moemesh_worker_engine_calls_total{on}`: engine calls run on the engine thread (`thread`) and those
    `run_inline` ran on the event loop itself (`loop`: a short round on an idle worker), read at scrape time."""

    def __init__(self, et: EngineThread) -> None:
        self.et = et

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily(
            "moemesh_worker_engine_calls",
            "engine calls by the thread that ran them (loop: run inline)",
            labels=["on"],
        )
        c.add_metric(["thread"], self.et.thread_calls)
        c.add_metric(["loop"], self.et.loop_calls)
        yield c
