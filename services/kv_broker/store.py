"""JetStream KV buckets as the broker's only state, mirrored in memory."""

# Each bucket holds one record type (msgpack). A watcher keeps an in-memory mirror of every key, so reads
# cost no round trip and a freshly started broker (or a second replica) sees everything the others
# wrote. Writes are compare-and-set on the revision the writer read: two replicas (or two concurrent
# handlers) changing one handle cannot both win; the loser re-reads and re-decides (`Conflict`). A delete
# leaves a marker in the bucket's stream; markers older than `marker_age_s` are purged every
# `purge_every_s`, or a bucket of short-lived keys (handles) would grow by one message per key forever.
# After a reconnect the owner calls `resync`: the watcher resumes where it was, but an uncleanly restarted
# nats-server may have revived purged keys behind it.

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import msgspec
import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue

from libs.bus.event_wait import cancel_and_wait
from libs.bus.periodic import Periodic

log = logging.getLogger("moemesh.kv_broker.store")

R = TypeVar("R", bound=msgspec.Struct)
MARKER_AGE_S = 600.0  # a delete marker older than this is purged (every watcher has long applied it)
PURGE_EVERY_S = 300.0


class Conflict(Exception):
    """Someone else changed (or deleted) the key since it was read."""


class Bucket(Generic[R]):
    def __init__(
        self, js: Any, name: str, record_type: type[R], replicas: int = 1, marker_age_s: float = MARKER_AGE_S,
        purge_every_s: float = PURGE_EVERY_S,
    ) -> None:  # fmt: skip
        self._js = js
        self._marker_age_s = marker_age_s
        self._purge = (
            Periodic(purge_every_s, self.purge_markers, f"purge-{name}") if purge_every_s > 0 else None
        )
        self.name = name
        self._replicas = replicas
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(record_type)
        self._kv: KeyValue | None = None
        self._mirror: dict[str, tuple[R, int]] = {}
        self._deleted: dict[str, int] = {}  # key -> last revision seen before our own delete
        self._watch_task: asyncio.Task | None = None
        self._watcher: Any = None
        self.changed = asyncio.Event()  # set on every change seen by the watcher (consumers clear it)

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError(f"bucket {self.name} is not open")
        return self._kv

    async def open(self, timeout: float = 10.0) -> None:
        """Create the bucket if needed (file storage, latest value only), then load every key."""
        try:
            self._kv = await self._js.key_value(self.name)
        except nats.js.errors.BucketNotFoundError:
            self._kv = await self._js.create_key_value(
                bucket=self.name, history=1, replicas=self._replicas, storage=api.StorageType.FILE
            )
        self._watcher = await self.kv.watchall()
        loaded = asyncio.get_running_loop().create_future()
        self._watch_task = asyncio.create_task(self._watch(loaded))
        await asyncio.wait_for(loaded, timeout)
        if self._purge is not None:
            self._purge.start()

    async def _server_entries(self) -> list[Any]:
        """The latest entry of every key the server holds, delete and purge markers included (a snapshot)."""
        watcher = await self.kv.watchall()
        entries = []
        try:
            async for e in watcher:
                if e is None:  # the snapshot is complete
                    break
                entries.append(e)
        finally:
            await watcher.stop()
        return entries

    async def purge_markers(self) -> int:
        """Remove the delete markers older than marker_age_s (every watcher has long applied them);
        returns how many."""
        cutoff = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=self._marker_age_s)
        old = [
            e.key for e in await self._server_entries()
            if e.operation in ("DEL", "PURGE") and e.created is not None and e.created < cutoff
        ]  # fmt: skip
        for key in old:
            await self._js.purge_stream(f"KV_{self.name}", subject=f"$KV.{self.name}.{key}")
        return len(old)

    async def resync(self) -> tuple[int, int]:
        """Make the mirror what the server holds now, after the connection came back: a nats-server that
        restarted uncleanly may hold entries the watcher never delivers (2.15 revives the last value of a
        key whose delete marker was purged: an older sequence than where the watcher resumes) and lack
        writes it acknowledged just before it died. Returns (keys the mirror gained, keys it dropped)."""
        deleted = dict(self._deleted)  # our deletes before the snapshot began
        start = (await self._js.stream_info(f"KV_{self.name}")).state.last_seq
        held: set[str] = set()
        gained = 0
        for e in await self._server_entries():
            if e.operation in ("DEL", "PURGE"):
                continue
            held.add(e.key)
            if e.revision <= deleted.get(e.key, -1) == self._deleted.get(e.key):
                # the server's latest is a value our delete overtook, so the delete's marker is gone (lost in
                # the restart, or purged and the value revived) before the watcher delivered it: the key is back
                del self._deleted[e.key]
            had = e.key in self._mirror
            self._apply(e)  # an entry our own delete overtook stays out
            gained += not had and e.key in self._mirror
        gone = [k for k, (_, rev) in self._mirror.items() if k not in held and rev <= start]
        for k in gone:  # not on the server, and not written since the snapshot began
            del self._mirror[k]
        if gained or gone:
            self.changed.set()
        return gained, len(gone)

    async def _watch(self, loaded: asyncio.Future) -> None:
        try:
            async for entry in self._watcher:
                if entry is None:  # the initial snapshot is complete
                    if not loaded.done():
                        loaded.set_result(None)
                    continue
                self._apply(entry)
        except Exception as e:  # the mirror would go stale silently: make it loud
            log.exception("watcher of bucket %s stopped", self.name)
            if not loaded.done():
                loaded.set_exception(e)

    def _apply(self, entry: Any) -> None:
        gone = self._deleted.get(entry.key)
        if gone is not None:
            if entry.revision <= gone:
                return  # an older write, overtaken by our delete
            del self._deleted[entry.key]
        current = self._mirror.get(entry.key)
        if current is not None and current[1] >= entry.revision:
            return  # our own write got here first
        if entry.operation in ("DEL", "PURGE"):
            self._mirror.pop(entry.key, None)
        else:
            try:
                self._mirror[entry.key] = (self._decoder.decode(entry.value), entry.revision)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error(
                    "bucket %s key %s holds an undecodable record, ignored: %s", self.name, entry.key, e
                )
                return
        self.changed.set()

    async def close(self) -> None:
        if self._purge is not None:
            await self._purge.stop()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        if self._watch_task is not None:
            await cancel_and_wait(self._watch_task)  # again while it runs on: a cancel lost in nats-py

    # --- reads (mirror) ---
    def get(self, key: str) -> tuple[R, int] | None:
        return self._mirror.get(key)

    def items(self) -> Iterator[tuple[str, R]]:
        return ((k, rec) for k, (rec, _) in list(self._mirror.items()))

    def __len__(self) -> int:
        return len(self._mirror)

    async def fetch(self, key: str) -> tuple[R, int] | None:
        """The key read from the server itself (after a Conflict, the mirror may lag)."""
        try:
            entry = await self.kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if entry.value is None or entry.revision is None:
            return None
        pair = (self._decoder.decode(entry.value), entry.revision)
        self._remember(key, *pair)
        return pair

    def _remember(self, key: str, rec: R, revision: int) -> None:
        current = self._mirror.get(key)
        if current is None or current[1] < revision:
            self._mirror[key] = (rec, revision)

    # --- writes (compare-and-set) ---
    async def create(self, key: str, rec: R) -> int:
        """Write a key that must not exist; Conflict if it does."""
        try:
            rev = await self.kv.create(key, self._encoder.encode(rec))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Conflict(key) from None
        self._remember(key, rec, rev)
        return rev

    async def update(self, key: str, rec: R, revision: int) -> int:
        """Replace the key only if it is still at `revision`; Conflict otherwise."""
        try:
            rev = await self.kv.update(key, self._encoder.encode(rec), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Conflict(key) from None
        self._remember(key, rec, rev)
        return rev

    async def put(self, key: str, rec: R) -> int:
        """Unconditional write (last writer wins: worker registrations)."""
        rev = await self.kv.put(key, self._encoder.encode(rec))
        self._remember(key, rec, rev)
        return rev

    async def delete(self, key: str, revision: int | None = None) -> None:
        """Delete (only if still at `revision`, when given); gone from the mirror at once."""
        try:
            await self.kv.delete(key, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Conflict(key) from None
        current = self._mirror.pop(key, None)
        if current is not None:  # else the watcher already applied the delete marker
            self._deleted[key] = max(revision or 0, current[1])
