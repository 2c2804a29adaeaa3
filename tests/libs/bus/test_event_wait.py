"""wait_event: set / timeout / no limit, and a cancel that arrives as the event is set is never lost;
cancel_and_wait ends a loop task whose cancel a library's asyncio.wait_for lost."""

from __future__ import annotations

import asyncio
import sys

import pytest

from libs.bus.event_wait import cancel_and_wait, wait_event


async def test_true_when_set_false_on_timeout() -> None:
    ev = asyncio.Event()
    assert not await wait_event(ev, 0.01)
    asyncio.get_running_loop().call_soon(ev.set)
    assert await wait_event(ev, None)


async def test_a_cancel_that_arrives_as_the_event_is_set_still_cancels() -> None:
    """The race asyncio.wait_for loses on Python 3.11: the inner wait is done, its callback not yet run,
    and the cancel comes in between. A loop task built on it would outlive cancel() and hang its owner."""

    async def loop(ev: asyncio.Event) -> None:
        while True:
            await wait_event(ev, 60.0)
            ev.clear()

    for _ in range(50):
        ev = asyncio.Event()
        task = asyncio.create_task(loop(ev))
        await asyncio.sleep(0)  # the task waits on the event
        ev.set()
        task.cancel()  # in the same turn of the loop as the set
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)


async def _request_loop(replies: list[asyncio.Future]) -> None:
    """A loop task making request after request as nats-py does (asyncio.wait_for on the reply)."""
    while True:
        reply = asyncio.get_running_loop().create_future()
        replies.append(reply)
        await asyncio.wait_for(reply, 60.0)


async def test_cancel_and_wait_ends_a_task_whose_cancel_wait_for_lost() -> None:
    replies: list[asyncio.Future] = []
    task = asyncio.create_task(_request_loop(replies))
    await asyncio.sleep(0)  # waiting for its first reply
    replies[-1].set_result(b"ok")
    task.cancel()  # in the same turn as the reply: wait_for returns the reply and the loop goes on
    done, _ = await asyncio.wait({task}, timeout=0.2)
    if sys.version_info < (3, 12):  # 3.12's wait_for is built on asyncio.timeout
        assert not done and len(replies) == 2  # a plain `await task` would hang here
    stopping = asyncio.create_task(cancel_and_wait(task, retry_s=0.05))
    done, _ = await asyncio.wait({stopping}, timeout=3.0)
    assert stopping in done and task.cancelled()


async def test_cancel_and_wait_raises_what_the_task_raised() -> None:
    async def boom() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(boom())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait(task)
