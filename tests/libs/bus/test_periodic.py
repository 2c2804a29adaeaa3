"""Periodic keeps a fixed rate: a slow run does not push every later heartbeat back."""

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
