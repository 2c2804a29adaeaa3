"""Running a libs.bus Service inside a test: start it in a task and wait for its `started` event (a
setup error raises in the test, not in a background task), stop it with a drain."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator


async def start_service(svc, timeout: float = 10.0, install_signals: bool = False) -> asyncio.Task:
    """Run `svc` (without signal handlers unless asked); return its task once it says started. A setup
    error raises here; not started within `timeout` fails the test."""
    task = asyncio.create_task(svc.run(install_signals=install_signals))
    ready = asyncio.ensure_future(svc.started.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    ready.cancel()
    assert svc.started.is_set(), f"{type(svc).__name__} did not start within {timeout} s"
    return task


async def stop_service(svc, task: asyncio.Task, timeout: float = 10.0) -> None:
    svc.request_stop()
    await asyncio.wait_for(task, timeout)


@contextlib.asynccontextmanager
async def engine_held(et, timeout: float = 30.0) -> AsyncIterator[None]:
    """Keep a worker's engine thread (libs.worker.engine_thread.EngineThread) busy for the block: every
    engine call made meanwhile queues behind it. Released, and its call awaited, on exit."""
    hold = threading.Event()
    busy = et.submit(hold.wait, timeout)  # queued now, before the block's first engine call
    try:
        yield
    finally:
        hold.set()
        await busy
