"""A nats-server killed and restarted can bring purged keys back (2.15: the last value of a key whose delete
marker was purged is revived by its store's recovery, when other markers share its message block). Revived
handle records must not stay in the bucket: after the reconnect the broker reads its buckets again
(`Bucket.resync`) and the sweep forgets them. In an 8-minute soak ~330 revived keys stayed until the end,
older sequences than where the broker's watcher resumed; here, right after the writes, the watcher may
deliver them again by itself, so the resync's own part is checked in test_store_markers.py and
test_broker.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.js.errors
import pytest

from libs.bus import Bus, now_ms
from libs.natsd import start_nats_server
from proto import messages as m
from proto import subjects
from services.kv_broker.service import BrokerSettings, KvBroker
from tests.service_helpers import start_service, stop_service

from .factories import handle, register, worker

pytestmark = pytest.mark.e2e
N = 20


class Clock:
    def __init__(self) -> None:
        self.now = now_ms()

    def __call__(self) -> int:
        return self.now


async def until(pred: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # polls a condition the broker reaches asynchronously


async def server_keys(url: str, bucket: str) -> int:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(bucket)
        try:
            return len(await kv.keys())
        except nats.js.errors.NoKeysError:
            return 0
    finally:
        await nc.close()


async def test_keys_a_restarted_server_revived_are_read_again_and_swept(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    server = start_nats_server(store_dir=store)
    tag, clock = uuid.uuid4().hex[:10], Clock()
    s = BrokerSettings(
        nats_url=server.url, handles_bucket=f"h_{tag}", workers_bucket=f"w_{tag}", drain_timeout_s=2,
        purge_every_s=0, max_sweep_interval_s=0.05,
    )  # fmt: skip
    b = KvBroker(s, clock=clock)
    task = await start_service(b)
    client = await Bus.connect(server.url, "revived-test")
    try:
        w = worker(f"decode-{uuid.uuid4().hex[:6]}")
        assert (await client.request(subjects.BROKER, register(w), m.BrokerReply, timeout=5)).ok
        assert b.handles is not None

        async def mirror_empty() -> bool:
            return len(b.handles) == 0

        async def handles_forgotten() -> None:  # N handles made, consumed and forgotten (delete markers left)
            for _ in range(N):
                h = handle(clock.now + 60_000, w)
                for msg in (m.CreateHandle(handle=h), m.HandleConsumed(handle_id=h.handle_id)):
                    assert (await client.request(subjects.BROKER, msg, m.BrokerReply, timeout=5)).ok
            clock.now += s.retention_ms + 1  # past retention: the sweep forgets (deletes) them
            await until(mirror_empty, "the sweep to forget the consumed handles")

        await handles_forgotten()
        between = time.time()
        await handles_forgotten()
        b.handles._marker_age_s = time.time() - between  # the first N markers are old, the last N not
        assert await b.handles.purge_markers() == N  # (a store with no marker left revives nothing)
        assert await server_keys(server.url, s.handles_bucket) == 0

        port = server.port
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        server = start_nats_server(port=port, store_dir=store)
        revived = await server_keys(server.url, s.handles_bucket)
        if revived == 0:
            pytest.skip("this nats-server revives no purged key on an unclean restart")

        async def none_left() -> bool:
            return await server_keys(server.url, s.handles_bucket) == 0

        await until(none_left, f"the broker to find and forget the {revived} revived handles")
        await until(mirror_empty, "the broker's mirror to follow its deletes")
    finally:
        await client.close()
        await stop_service(b, task)
        server.stop()
