"""EarlyPrefills: a started prompt's result goes to its PrefillTask; a dropped one is released exactly
once after it finishes, and a restart of the same id waits for that release; late starts expire."""

from __future__ import annotations

import asyncio

from services.prefill_worker.early import EarlyPrefills


class Engine:
    """Records prefill / release order; a prefill waits on `gate`."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = asyncio.Event()

    def prefill(self, rid: str):
        async def run() -> str:
            self.calls.append(f"prefill {rid}")
            await self.gate.wait()
            return f"result {rid}"

        return run

    async def release(self, rid: str) -> None:
        self.calls.append(f"release {rid}")


async def test_the_task_takes_the_started_result() -> None:
    eng = Engine()
    early = EarlyPrefills(eng.release, ttl_s=30)
    assert early.start("r1", eng.prefill("r1")) and not early.start("r1", eng.prefill("r1"))
    eng.gate.set()
    task = early.take("r1")
    assert task is not None and await task == "result r1"
    assert early.take("r1") is None and len(early) == 0 and eng.calls == ["prefill r1"]


async def test_a_drop_releases_once_after_the_run_and_a_restart_waits_for_it() -> None:
    eng = Engine()
    early = EarlyPrefills(eng.release, ttl_s=30)
    early.start("r1", eng.prefill("r1"))
    await asyncio.sleep(0)  # let the prefill begin
    assert early.drop("r1") and not early.drop("r1")
    early.start("r1", eng.prefill("r1"))  # placed here again
    eng.gate.set()
    second = early.take("r1")
    assert second is not None and await second == "result r1"
    assert eng.calls == ["prefill r1", "release r1", "prefill r1"]


async def test_starts_without_a_task_expire_and_close_releases_the_rest() -> None:
    now = [0.0]
    eng = Engine()
    eng.gate.set()
    early = EarlyPrefills(eng.release, ttl_s=5, clock=lambda: now[0])
    early.start("old", eng.prefill("old"))
    now[0] = 3.0
    early.start("new", eng.prefill("new"))
    now[0] = 6.0
    assert early.expire() == ["old"] and "new" in early
    await early.close()
    assert sorted(c for c in eng.calls if c.startswith("release")) == ["release new", "release old"]
