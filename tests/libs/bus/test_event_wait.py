"""wait_event: set / timeout / no limit, and a cancel that arrives as the event is set is never lost."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus.event_wait import wait_event


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
