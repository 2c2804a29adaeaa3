"""The heartbeat's stall watchdog: a worker whose beats stop (a blocked loop, a native call holding the GIL)
writes every thread's stack to stderr; beats that keep coming, or a clean stop, write nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from libs.worker.heartbeat import Heartbeater
    from proto import messages as m

    class Bus:
        sent = 0
        async def publish(self, subject, msg):
            Bus.sent += 1

    STATS = dict(running=0, waiting=0, free_pages=1, total_pages=1, page_size=16, max_context=64)

    def stuck_in_a_blocking_call(seconds):
        time.sleep(seconds)  # the loop and this thread both wait: what a GIL-holding native call looks like

    async def main(case):
        # 0.5 s against a 3 s stall; 2 s for the beating case, so that a loaded machine's scheduling gap
        # between 20 ms beats cannot pass for a stall
        stall_dump_s = 0.5 if case == "stall" else 2.0
        hb = Heartbeater(Bus(), "w-0", m.Role.DECODE, "tiny", 20, lambda: STATS, stall_dump_s=stall_dump_s)
        hb.start()
        while Bus.sent < 3:
            await asyncio.sleep(0.01)
        if case == "stall":
            stuck_in_a_blocking_call(3.0)
        else:  # beats keep coming for longer than the watchdog's time, then a clean stop
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                await asyncio.sleep(0.02)
            await hb.stop()
            time.sleep(2.5)  # past the watchdog's time after the stop: nothing may be written
        print("sent", Bus.sent, file=sys.stderr)

    asyncio.run(main(sys.argv[1]))
    """
)


def run(case: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stderr


def test_a_stall_dumps_every_threads_stack():
    err = run("stall")
    assert "Timeout (0:00:00.500000)!" in err, err
    assert "stuck_in_a_blocking_call" in err, err
    assert err.count("Timeout (") == 1, err  # once per stall, re-armed by the next beat


def test_beats_and_a_clean_stop_dump_nothing():
    err = run("beating")
    assert "Timeout (" not in err, err
    assert int(err.split("sent ")[1].split()[0]) > 10, err  # the beats did go out meanwhile
