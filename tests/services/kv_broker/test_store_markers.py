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


async def deafen(bucket: Bucket) -> None:
    """The bucket's watcher stopped: it delivers nothing from here on."""
    assert bucket._watcher is not None and bucket._watch_task is not None
    await bucket._watcher.stop()
    await bucket._watch_task


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
        await deafen(bucket)
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


async def test_resync_takes_back_a_key_whose_delete_marker_the_server_lost(nats_server: str) -> None:
    """A delete whose marker the watcher never delivered, and which the server no longer holds (its latest
    entry is the value again, as after a marker purged and the value revived), no longer hides the key."""
    nc = await nats.connect(nats_server)
    js = nc.jetstream()
    name = f"lostdel_{uuid.uuid4().hex[:8]}"
    # a KV stream of two entries a key that allows deleting one message: this test stands in for a server
    # that lost the delete marker (the broker's own buckets keep one and refuse such deletes)
    await js.add_stream(name=f"KV_{name}", subjects=[f"$KV.{name}.>"], max_msgs_per_subject=2,
                        allow_rollup_hdrs=True, deny_delete=False)  # fmt: skip
    bucket = Bucket(js, name, Rec, purge_every_s=0)
    await bucket.open()
    try:
        await bucket.create("back", Rec(1))
        await bucket.create("gone", Rec(2))
        await deafen(bucket)  # the delete markers below are never delivered
        await bucket.delete("gone")
        await bucket.delete("back")
        marker = (await js.stream_info(f"KV_{name}")).state.last_seq  # "back"'s delete marker
        await js.delete_msg(f"KV_{name}", marker)  # the server's latest for "back" is its value again
        assert list(bucket.items()) == []
        assert await bucket.resync() == (1, 0)
        assert [(k, r.n) for k, r in bucket.items()] == [("back", 1)]  # "gone" keeps its marker: stays out
    finally:
        await bucket.close()
        await js.delete_key_value(name)
        await nc.close()
