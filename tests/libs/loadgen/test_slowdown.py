"""The slow-down experiment's watch (libs.loadgen.slowdown._watch) against a fake admin API and clock."""

from __future__ import annotations

import asyncio

from libs.loadgen.slowdown import SlowdownConfig, _watch


async def test_the_release_is_stamped_before_the_slow_down_call_returns() -> None:
    """The workers run at full speed from some moment inside the admin call; a short decode can end before its
    reply. Stamped after the call, every request had "finished before the release" (CI, under load)."""
    now = [10.0]
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    class SlowAdmin:
        async def load(self) -> tuple[int, int]:
            return 4, 0

        async def set_slowdown(self, ms: float) -> None:
            now[0] += 1.0  # the round trip to every decode worker
            done.set_result(None)  # meanwhile every request finished

    w = await _watch(SlowAdmin(), asyncio.ensure_future(done), lambda: now[0], SlowdownConfig(150.0, 4))  # type: ignore[arg-type]
    assert (w.release_s, w.reason, w.batch_at_release) == (10.0, "target", 4)
