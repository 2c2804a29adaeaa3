"""`wait_event`: wait for an asyncio.Event with a timeout, in a loop task that may be cancelled at any moment;
`cancel_and_wait`: stop such a loop task even when a cancel is lost inside what it awaits."""

# Not `asyncio.wait_for(event.wait(), t)`: on Python 3.11 it loses a cancellation that arrives while the
# event is being set (it returns the inner result instead of raising CancelledError), so a loop task that is
# woken often (a heartbeat, a submit) can outlive its `cancel()` and hang whoever awaits it at shutdown.
# `asyncio.timeout` has no such window. Libraries still use asyncio.wait_for (nats-py's request, so every
# JetStream write): a loop task cancelled while one of those completes goes on, and its owner's `await task`
# never ends. `cancel_and_wait` cancels again while the task runs on; the next cancel lands at its next await.

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """True when the event is set within `timeout` seconds (None: no limit), False on timeout."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(task: asyncio.Task, retry_s: float = 0.5) -> None:
    """Cancel `task` and wait until it has ended, cancelling it again every `retry_s` while it runs on (a
    cancel lost inside a library's asyncio.wait_for); its CancelledError is swallowed, another error raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
