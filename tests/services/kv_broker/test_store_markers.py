"""A bucket of short-lived keys does not grow by a delete marker per key forever: markers older than the
bucket's marker age are purged from its stream, newer ones stay (a watcher may not have applied them yet);
against a real nats-server."""

from __future__ import annotations

import uuid

import msgspec
import nats

from services.kv_broker.store import Bucket


class Rec(msgspec.Struct):
    n: int


async def test_old_delete_markers_are_purged_and_live_keys_stay(nats_server: str) -> None:
    nc = await nats.connect(nats_server)
    js = nc.jetstream()
    name = f"markers_{uuid.uuid4().hex[:8]}"
    bucket = Bucket(js, name, Rec, marker_age_s=3600, purge_every_s=0)
    await bucket.open()
    try:
        for i in range(6):
            await bucket.create(f"k{i}", Rec(i))
        for i in range(4):
            await bucket.delete(f"k{i}")

        async def messages() -> int:
            return (await js.stream_info(f"KV_{name}")).state.messages

        assert await messages() == 6  # 2 values + 4 markers
        assert await bucket.purge_markers() == 0  # younger than an hour: kept
        assert await messages() == 6
        bucket._marker_age_s = 0  # every marker is old now
        assert await bucket.purge_markers() == 4
        assert await messages() == 2
        assert sorted(k for k, _ in bucket.items()) == ["k4", "k5"]
        assert sorted(await bucket.kv.keys()) == ["k4", "k5"]
    finally:
        await bucket.close()
        await js.delete_key_value(name)
        await nc.close()


async def test_resync_makes_the_mirror_what_the_server_holds(nats_server: str) -> None:
    """Keys the watcher will never deliver (revived by a restarted server behind its position) join the
    mirror; keys the server lost (acknowledged writes gone with an unclean restart) leave it."""
    nc = await nats.connect(nats_server)
    js = nc.jetstream()
    name = f"resync_{uuid.uuid4().hex[:8]}"
    bucket = Bucket(js, name, Rec, purge_every_s=0)
    await bucket.open()
    try:
        await bucket.create("kept", Rec(0))
        await bucket.create("lost", Rec(1))
        assert bucket._watcher is not None and bucket._watch_task is not None
        await bucket._watcher.stop()  # the watcher delivers nothing from here on
        await bucket._watch_task
        kv = await js.key_value(name)
        await kv.put("revived", msgspec.msgpack.encode(Rec(2)))
        await kv.purge("lost")
        assert sorted(k for k, _ in bucket.items()) == ["kept", "lost"]
        assert await bucket.resync() == (1, 1)
        assert sorted((k, r.n) for k, r in bucket.items()) == [("kept", 0), ("revived", 2)]
        assert await bucket.resync() == (0, 0)
    finally:
        await bucket.close()
        await js.delete_key_value(name)
        await nc.close()
