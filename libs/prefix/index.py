"""The prefix index (the kv-broker's, and each scheduler's replica of it): which worker holds which KV
block, built from the workers' KV events. Pure: no I/O; times (monotonic seconds) are passed in."""

# Per worker it keeps the epoch and last seq applied, the set of block hashes held, and whether it is
# resyncing. Rules:
# - The next seq (last + 1) applies; an older or repeated one is ignored (a snapshot already covered it).
# - A seq jump means missed events: the worker is *resyncing*. Its later events are buffered (bounded)
#   and `apply` returns True: the caller asks the worker for a KvSnapshot (keeping at most one request in
#   flight; `needs_snapshot` says whether one is still wanted). Until it arrives the old blocks still
#   answer queries: slightly stale beats empty.
# - A first event of an unknown worker or a new epoch (the worker restarted, its cache is empty): the old
#   blocks are dropped; seq 1 applies at once, anything later starts a resync.
# - A snapshot replaces the worker's blocks as of its seq, then the buffered events after it are replayed
#   in order (a gap among them starts another resync). A snapshot of the same epoch older than what is
#   applied already is ignored, as the events it would undo are already in.
# - Liveness: every message from a worker (heartbeat, event, snapshot) moves its deadline to now +
#   `dead_after_intervals` x its heartbeat interval; `expire` drops workers past it, `drop_worker` one that
#   said WorkerGone. A dead worker's blocks must not attract requests.
#
# Overlap: for a prompt's block hashes (in order), each worker's run of leading blocks it holds; radix
# caches evict leaves first, so a worker holding block i almost always holds 0..i-1 too.
# Tiers: a held block is on the worker's device or its host tier (BlocksStored.tier; a snapshot's
# host_hashes); blocks put in the shared store are one set for every worker that reads the store, kept
# as a bounded hint (the store evicts without telling). `tiered_overlap` splits each run by tier.

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libs.prefix import leading
from proto.messages import BlocksRemoved, BlocksStored, KvSnapshot, KvTier

KvEvent = BlocksStored | BlocksRemoved
DEFAULT_INTERVAL_S = 1.0  # assumed heartbeat interval until a heartbeat tells the real one


@dataclass
class _Worker:
    epoch: str
    seq: int = 0
    blocks: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)  # of blocks, those on its host tier
    store: bool = False  # it reads the shared store
    resyncing: bool = False
    buffered: list[KvEvent] = field(default_factory=list)
    deadline: float = float("inf")


class PrefixIndex:
    def __init__(
        self, dead_after_intervals: float = 3.0, max_buffered: int = 1024, max_store_blocks: int = 1 << 20
    ) -> None:
        if not dead_after_intervals > 0:
            raise ValueError(f"dead_after_intervals must be > 0, got {dead_after_intervals}")
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {max_buffered}")
        self.dead_after_intervals = dead_after_intervals
        self.max_buffered = max_buffered
        self._workers: dict[str, _Worker] = {}
        self._owners: dict[int, set[str]] = {}  # block hash -> workers holding it
        self._intervals: dict[str, float] = {}  # heartbeat interval per worker, indexed or not yet
        # blocks some worker put in the shared store, most recent last (a hint: the store evicts unseen)
        self._store: OrderedDict[int, None] = OrderedDict()
        self.max_store_blocks = max_store_blocks

    # --- sizes (metrics) ---
    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._owners)

    @property
    def num_entries(self) -> int:
        """(block, worker) pairs: the index's real size."""
        return sum(len(w.blocks) for w in self._workers.values())

    @property
    def num_store_blocks(self) -> int:
        return len(self._store)

    @property
    def has_tiers(self) -> bool:
        """Some block is known off a device (a host tier or the store): tiered_overlap says more than overlap."""
        return bool(self._store) or any(w.host for w in self._workers.values())

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def blocks_of(self, worker_id: str) -> set[int]:
        w = self._workers.get(worker_id)
        return set(w.blocks) if w else set()

    def seq_of(self, worker_id: str) -> tuple[str, int] | None:
        w = self._workers.get(worker_id)
        return (w.epoch, w.seq) if w else None

    def needs_snapshot(self, worker_id: str) -> bool:
        """Unknown, or known to have missed events."""
        w = self._workers.get(worker_id)
        return w is None or w.resyncing

    # --- events ---
    def apply(self, ev: KvEvent, now: float) -> bool:
        """Take one event; True when the worker must be resynced from a snapshot."""
        w = self._workers.get(ev.worker_id)
        if w is None or w.epoch != ev.epoch:
            w = self._reset(ev.worker_id, ev.epoch, w)
            w.resyncing = ev.seq != 1
        self._touch(ev.worker_id, w, now)
        if w.resyncing:
            self._buffer(w, ev)
            return True
        if ev.seq <= w.seq:
            return False
        if ev.seq > w.seq + 1:
            w.resyncing = True
            self._buffer(w, ev)
            return True
        self._apply(ev.worker_id, w, ev)
        return False

    def load_snapshot(self, snap: KvSnapshot, now: float) -> bool:
        """Take a snapshot (then replay buffered events after it); True when a resync is needed still."""
        w = self._workers.get(snap.worker_id)
        if w is not None and w.epoch == snap.epoch and not w.resyncing and snap.seq <= w.seq:
            self._touch(snap.worker_id, w, now)
            return False  # older than what is applied
        buffered = sorted(
            (e for e in (w.buffered if w else []) if e.epoch == snap.epoch and e.seq > snap.seq),
            key=lambda e: e.seq,
        )
        w = self._reset(snap.worker_id, snap.epoch, w)
        self._touch(snap.worker_id, w, now)
        self._set_blocks(snap.worker_id, w, set(snap.hashes))
        w.host, w.store = set(snap.host_hashes) & w.blocks, snap.store
        w.seq = snap.seq
        for i, ev in enumerate(buffered):
            if ev.seq <= w.seq:
                continue
            if ev.seq > w.seq + 1:
                w.resyncing, w.buffered = True, buffered[i:]
                return True
            self._apply(snap.worker_id, w, ev)
        return False

    # --- liveness ---
    def heard(self, worker_id: str, now: float, interval_s: float | None = None) -> None:
        """A heartbeat (or any message) from a worker; unknown workers are not created here."""
        if interval_s is not None and interval_s > 0:
            self._intervals[worker_id] = interval_s
        w = self._workers.get(worker_id)
        if w is not None:
            self._touch(worker_id, w, now)

    def expire(self, now: float) -> list[str]:
        dead = [wid for wid, w in self._workers.items() if now > w.deadline]
        for wid in dead:
            self.drop_worker(wid)
        return dead

    def drop_worker(self, worker_id: str) -> int:
        """Forget a worker and its blocks; returns how many blocks it held."""
        self._intervals.pop(worker_id, None)
        w = self._workers.pop(worker_id, None)
        if w is None:
            return 0
        n = len(w.blocks)
        self._set_blocks(worker_id, w, set())
        return n

    # --- queries ---
    def overlap(self, hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading blocks of `hashes` it holds (workers holding none left out)."""
        return leading(hashes, self._owners)

    def tiered_overlap(self, hashes: Sequence[int]) -> dict[str, tuple[int, int, int]]:
        """Worker id -> (device, host, store) blocks of the prompt's leading run it can serve: its own run
        (device blocks first, its host tier below them), then the blocks after it that the shared store
        holds, for a worker that reads the store (workers with none left out)."""
        local = leading(hashes, self._owners)
        run_from: dict[int, int] = {}  # start -> store run length, computed once per start
        out: dict[str, tuple[int, int, int]] = {}
        for wid, w in self._workers.items():
            n = local.get(wid, 0)
            host = sum(1 for h in hashes[:n] if h in w.host) if w.host and n else 0
            store = 0
            if w.store and self._store:
                if n not in run_from:
                    i = n
                    while i < len(hashes) and hashes[i] in self._store:
                        i += 1
                    run_from[n] = i - n
                store = run_from[n]
            if n or store:
                out[wid] = (n - host, host, store)
        return out

    # --- internals ---
    def _reset(self, wid: str, epoch: str, old: _Worker | None) -> _Worker:
        """A fresh record (callers touch it next); the old one's blocks leave the index."""
        if old is not None:
            self._set_blocks(wid, old, set())
        w = _Worker(epoch=epoch)
        self._workers[wid] = w
        return w

    def _touch(self, wid: str, w: _Worker, now: float) -> None:
        w.deadline = now + self.dead_after_intervals * self._intervals.get(wid, DEFAULT_INTERVAL_S)

    def _buffer(self, w: _Worker, ev: KvEvent) -> None:
        w.buffered.append(ev)
        if len(w.buffered) > self.max_buffered:  # the oldest go; replay then finds a gap and resyncs again
            del w.buffered[: len(w.buffered) - self.max_buffered]

    def _apply(self, wid: str, w: _Worker, ev: KvEvent) -> None:
        if isinstance(ev, BlocksStored):
            if ev.tier == KvTier.STORE:
                w.store = True
                self._stored(ev.hashes)
            else:
                self._add(wid, w, ev.hashes)
                if ev.tier == KvTier.HOST:
                    w.host.update(ev.hashes)
                else:
                    w.host.difference_update(ev.hashes)
        else:
            self._remove(wid, w, ev.hashes)
        w.seq = ev.seq

    def _set_blocks(self, wid: str, w: _Worker, blocks: set[int]) -> None:
        self._remove(wid, w, w.blocks - blocks)
        self._add(wid, w, blocks - w.blocks)

    def _add(self, wid: str, w: _Worker, hashes: Iterable[int]) -> None:
        for h in hashes:
            w.blocks.add(h)
            self._owners.setdefault(h, set()).add(wid)

    def _stored(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._store[h] = None
            self._store.move_to_end(h)
        while len(self._store) > self.max_store_blocks:
            self._store.popitem(last=False)

    def _remove(self, wid: str, w: _Worker, hashes: Iterable[int]) -> None:
        for h in list(hashes):
            w.blocks.discard(h)
            w.host.discard(h)
            owners = self._owners.get(h)
            if owners is not None:
                owners.discard(wid)
                if not owners:
                    del self._owners[h]
