"""Periodic keeps a fixed rate: a slow run does not push every later heartbeat back; stop() ends it even
when its run loses the cancel (a nats-py request completing at that moment)."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus.periodic import Periodic, next_due


def test_the_next_run_is_due_one_interval_after_the_last_was_due() -> None:
    assert next_due(10.0, now=10.06, interval_s=0.1) == pytest.approx(10.1)  # a 60 ms run: sleep 40 ms
    assert next_due(10.1, now=10.12, interval_s=0.1) == pytest.approx(10.2)  # no drift accumulates
    assert next_due(10.0, now=10.35, interval_s=0.1) == 10.35  # after a stall: now, not a burst of three


async def test_a_failing_run_does_not_stop_the_next() -> None:
    runs: list[int] = []
    again = asyncio.Event()

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise RuntimeError("publish while reconnecting")
        again.set()

    p = Periodic(0.01, flaky, "test-periodic")
    p.start()
    try:
        async with asyncio.timeout(5):
            await again.wait()
    finally:
        await p.stop()
    assert runs[:2] == [0, 1]


async def test_stop_ends_a_run_that_lost_the_cancel() -> None:
    replies: list[asyncio.Future] = []

    async def request() -> None:  # nats-py's request: asyncio.wait_for on the reply
        reply = asyncio.get_running_loop().create_future()
        replies.append(reply)
        await asyncio.wait_for(reply, 60.0)

    p = Periodic(0.0, request, "test-periodic")  # back to back
    p.start()
    await asyncio.sleep(0)
    assert len(replies) == 1
    replies[0].set_result(b"ok")  # the reply and the cancel in the same turn: wait_for returns the reply
    stopping = asyncio.create_task(p.stop())
    done, _ = await asyncio.wait({stopping}, timeout=3.0)  # (asyncio.wait: no cancel of its own to help)
    assert stopping in done, "stop() waits on a run that lost the cancel"
