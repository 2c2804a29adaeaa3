"""A worker's prefix-cache events on the bus (proto.subjects.kv_events) for the kv-broker's prefix index:
runs of BlocksStored / BlocksRemoved numbered by (epoch, seq), and the numbered set of blocks as the answer
to a KvSnapshotRequest, so the broker tells a restart (new epoch) from missed events (a seq jump)."""

# Who calls what: the radix cache calls blocks_stored / blocks_removed on the engine thread; after each
# engine call (EngineThread.after_call, on the event loop) `flush` numbers what it produced, and one sender
# task publishes in order, one message per run of a kind (at most max_hashes each): a step costs one or two
# messages, not one per page. The snapshot is exact because set and seq change only in `flush`. Events that
# fail to publish are dropped; the broker sees the gap and asks for a snapshot. With KV tiers the cache also
# calls blocks_moved (a run now on the device or the host: a BlocksStored of that tier) and the store tier
# reports its puts (tier STORE: told on, not counted as held here).

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from libs.bus import Bus
from libs.bus.event_wait import cancel_and_wait
from libs.worker.engine_thread import EngineThread
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.worker.kv_events")


REMOVED = -1  # the kind of a removal run; stored runs are kinds 0.. (their m.KvTier)


def coalesce(pending: list[tuple[int, list[int]]], max_hashes: int) -> list[tuple[int, list[int]]]:
    """Merge consecutive runs of one kind (REMOVED, or the tier stored in) in order, then cut them to
    max_hashes each."""
    runs: list[tuple[int, list[int]]] = []
    for kind, hashes in pending:
        if not hashes:
            continue
        if runs and runs[-1][0] == kind:
            runs[-1][1].extend(hashes)
        else:
            runs.append((kind, list(hashes)))
    return [(k, hs[i : i + max_hashes]) for k, hs in runs for i in range(0, len(hs), max_hashes)]


class KvEventPublisher:
    """The engine's CacheListener on one side, the worker's kv_events subject on the other."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        *,
        epoch: str | None = None,
        max_hashes: int = 4096,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        self.bus, self.worker_id = bus, subjects.check_token(worker_id)
        self.epoch = epoch or uuid.uuid4().hex[:16]
        self.max_hashes = max_hashes
        self.seq = 0
        self.blocks: dict[int, m.KvTier] = {}  # what events 1..seq add up to: held blocks and their tier
        self.store = False  # the worker reads the shared store (its snapshot says so)
        self._pending: list[tuple[int, list[int]]] = []  # from the engine thread, not yet numbered
        self._lock = threading.Lock()
        self._outbox: deque[m.BlocksStored | m.BlocksRemoved] = deque()
        self._ready = asyncio.Event()  # the outbox has messages
        self._idle = asyncio.Event()  # the outbox is empty and nothing is being sent
        self._idle.set()
        self._sender: asyncio.Task | None = None
        self._sent = Counter(
            "moemesh_kv_events_published", "KV cache event messages published", ["kind"], registry=registry
        )

    # --- engine thread (radix_cache.CacheListener) ---
    def blocks_stored(self, hashes: list[int]) -> None:
        with self._lock:
            self._pending.append((m.KvTier.DEVICE, hashes))

    def blocks_removed(self, hashes: list[int]) -> None:
        with self._lock:
            self._pending.append((REMOVED, hashes))

    def blocks_moved(self, hashes: list[int], tier: int) -> None:
        with self._lock:
            self._pending.append((int(tier), hashes))

    # --- event loop ---
    async def start(self, et: EngineThread) -> None:
        """Listen to the engine's cache (set on the engine thread), answer snapshots, start sending."""
        await self.bus.subscribe(subjects.kv_snapshot(self.worker_id), m.KvSnapshotRequest, self.on_snapshot)
        self.store = getattr(et.engine, "store_tier", None) is not None
        await et.call(et.engine.set_cache_listener, self)
        et.after_call = self.flush
        self.flush()
        self._sender = asyncio.create_task(self._send_loop())

    def flush(self) -> int:
        """Number and queue everything the cache reported since the last flush; returns messages queued."""
        with self._lock:
            pending, self._pending = self._pending, []
        runs = coalesce(pending, self.max_hashes)
        for kind, hashes in runs:
            self.seq += 1
            msg: m.BlocksStored | m.BlocksRemoved
            wid, epoch, seq = self.worker_id, self.epoch, self.seq
            if kind == REMOVED:
                for h in hashes:
                    self.blocks.pop(h, None)
                msg = m.BlocksRemoved(worker_id=wid, epoch=epoch, seq=seq, hashes=hashes)
            else:
                tier = m.KvTier(kind)
                if tier is m.KvTier.STORE:
                    self.store = True
                else:
                    self.blocks.update(dict.fromkeys(hashes, tier))
                msg = m.BlocksStored(worker_id=wid, epoch=epoch, seq=seq, hashes=hashes, tier=tier)
            self._outbox.append(msg)
        if runs:
            self._idle.clear()
            self._ready.set()
        return len(runs)

    async def on_snapshot(self, req: m.KvSnapshotRequest) -> m.KvSnapshot:
        self.flush()
        host = [h for h, t in self.blocks.items() if t is m.KvTier.HOST]
        return m.KvSnapshot(
            worker_id=self.worker_id, epoch=self.epoch, seq=self.seq, hashes=list(self.blocks),
            host_hashes=host, store=self.store,
        )  # fmt: skip

    async def _send_loop(self) -> None:
        subject = subjects.kv_events(self.worker_id)
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._outbox:
                msg = self._outbox[0]
                try:
                    await self.bus.publish(subject, msg)
                    self._sent.labels("stored" if isinstance(msg, m.BlocksStored) else "removed").inc()
                except Exception as e:  # the broker will see the seq gap and resync from a snapshot
                    log.warning("KV event %d not published (%s); the broker will resync", msg.seq, e)
                self._outbox.popleft()
            self._idle.set()

    async def stop(self, timeout: float = 2.0) -> None:
        """Send what is queued (bounded by `timeout`), then stop."""
        if self._sender is None:
            return
        self.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        await cancel_and_wait(self._sender)  # again while it runs on: a cancel lost in nats-py's wait_for
        self._sender = None


async def start_kv_events(
    bus: Bus, worker_id: str, et: EngineThread, registry: Any = None
) -> KvEventPublisher:
    """The worker shells' one call: a started publisher for this worker's engine."""
    pub = KvEventPublisher(bus, worker_id, registry=registry)
    await pub.start(et)
    return pub
