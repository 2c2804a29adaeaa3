"""Kill the broker process in the middle of traffic, start a new one: no handle is lost and leases
still expire (the state lives in JetStream KV, not in the process)."""

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import pytest

from libs.bus import Bus, NoResponders, RequestTimeout, now_ms
from proto import messages as m
from proto import subjects

from .factories import handle, register, worker

pytestmark = pytest.mark.e2e


def start_broker(nats_url: str, tag: str, log_path: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        MOEMESH_KV_BROKER_NATS_URL=nats_url, MOEMESH_KV_BROKER_HANDLES_BUCKET=f"h_{tag}",
        MOEMESH_KV_BROKER_WORKERS_BUCKET=f"w_{tag}", MOEMESH_KV_BROKER_MAX_SWEEP_INTERVAL_S="0.2",
    )  # fmt: skip
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "services.kv_broker"], env=env, stdout=log, stderr=log)


async def ask(bus: Bus, msg, timeout: float = 0.5) -> m.BrokerReply:
    """Ask until a broker answers: while none runs the request fails fast (no responders)."""
    async with asyncio.timeout(15):
        while True:
            try:
                return await bus.request(subjects.BROKER, msg, m.BrokerReply, timeout=timeout)
            except (NoResponders, RequestTimeout):
                await asyncio.sleep(0.01)  # retry pacing while the broker restarts, not a wait on a condition


async def test_broker_restart_mid_traffic_loses_nothing(nats_server, tmp_path):
    tag, log_path = uuid.uuid4().hex[:12], str(tmp_path / "broker.log")
    first = start_broker(nats_server, tag, log_path)
    second = None
    bus = await Bus.connect(nats_server, "restart-test")
    try:
        w = worker(f"decode-{uuid.uuid4().hex[:6]}")
        assert (await ask(bus, register(w))).ok
        expired: set[str] = set()
        all_short_expired = asyncio.Event()
        acked: dict[str, m.KvHandle] = {}
        short: set[str] = set()
        enough = {20: asyncio.Event(), 60: asyncio.Event()}
        stop = asyncio.Event()

        async def on_inbox(msg):
            if isinstance(msg, m.HandleExpired):
                expired.add(msg.handle_id)
                if stop.is_set() and short <= expired:
                    all_short_expired.set()

        await bus.subscribe(subjects.decode_inbox(w.worker_id), m.DecodeInbox, on_inbox)

        async def traffic():
            i = 0
            while not stop.is_set():
                now = now_ms()
                h = handle(now + (1000 if i % 4 == 0 else 60_000), w)
                r = await ask(bus, m.CreateHandle(handle=h))  # retried across the restart: idempotent
                assert r.ok, r.message
                acked[h.handle_id] = h
                if i % 4 == 0:
                    short.add(h.handle_id)
                i += 1
                for n, ev in enough.items():
                    if len(acked) >= n:
                        ev.set()

        traffic_task = asyncio.create_task(traffic())
        await asyncio.wait_for(enough[20].wait(), 10)
        written = next(hid for hid in acked if hid not in short)
        assert (await ask(bus, m.HandleWritten(handle_id=written))).ok
        first.send_signal(signal.SIGKILL)  # mid-traffic: creates keep coming
        assert first.wait(10) == -signal.SIGKILL
        before_kill = set(acked)
        second = start_broker(nats_server, tag, log_path)
        await asyncio.wait_for(enough[60].wait(), 15)
        stop.set()
        await asyncio.wait_for(traffic_task, 10)
        assert len(acked) > len(before_kill)  # traffic went on through the new broker

        listed = {
            r.handle.handle_id: r for r in (await ask(bus, m.ListHandles(decode_worker=w.worker_id))).handles
        }
        assert set(acked) <= set(listed)  # every handle any broker acknowledged is still there
        assert all(listed[hid].handle == h for hid, h in acked.items())
        assert listed[written].state == m.HandleState.WRITTEN

        if not short <= expired:
            await asyncio.wait_for(all_short_expired.wait(), 10)  # leases still expire after the restart
        final = {r.handle.handle_id: r.state for r in (await ask(bus, m.ListHandles())).handles}
        assert all(final[hid] == m.HandleState.EXPIRED for hid in short)
        # leases that ran out after the first broker died were ended by the second one
        assert short & before_kill and short & before_kill <= expired
        assert all(final[hid] != m.HandleState.EXPIRED for hid in acked if hid not in short)

        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0  # graceful drain on SIGTERM
    finally:
        await bus.close()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if os.path.exists(log_path):  # shown by pytest when the test fails
            with open(log_path, errors="replace") as f:
                print(f.read()[-5000:])
