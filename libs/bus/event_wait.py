"""`wait_event`: wait for an asyncio.Event with a timeout, in a loop task that may be cancelled at any moment."""

# Not `asyncio.wait_for(event.wait(), t)`: on Python 3.11 it loses a cancellation that arrives while the
# event is being set (it returns the inner result instead of raising CancelledError), so a loop task that is
# woken often (a heartbeat, a submit) can outlive its `cancel()` and hang whoever awaits it at shutdown.
# `asyncio.timeout` has no such window.

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
