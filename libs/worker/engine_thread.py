"""One thread owns the engine: every engine call from the asyncio side goes through `EngineThread.call`.

The engine is synchronous torch code and not thread-safe; running all of it on one dedicated thread
serializes calls (a reserve never races a step) while the event loop keeps serving the bus.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from libs.engine.protocol import EngineLike

T = TypeVar("T")


class EngineThread:
    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # run on the event loop after every call, failed ones too (KV cache events publish a step's batch)
        self.after_call: Callable[[], object] | None = None

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            if self.after_call is not None:
                self.after_call()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`call` without the coroutine: fn is queued for the engine thread before this returns (a task that
        awaits `call` queues it only once the task first runs, a pass of the event loop later). The future
        gets the result; after_call runs when it is done."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        if self.after_call is not None:
            after = self.after_call
            fut.add_done_callback(lambda _: after())
        return fut

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """fn on the engine thread, waited for by the calling thread (never the engine thread itself, nor
        the event loop: a transfer thread that must act where the engine's memory is)."""
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
