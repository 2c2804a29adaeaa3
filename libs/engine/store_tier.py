"""The store tier: KV pages shared between workers through a `PageStore`, named "<namespace>:<block hash>" and
staged in host pages. The engine thread calls `publish`, `prefetch`, `pending`, `cancel`, `poll` (results land only
there); one own thread talks to the store and calls `on_result` as each result is ready (a worker polls then: an
idle engine takes no step). Nothing raises into the engine: a failing store is down for `retry_s`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from libs.engine.page_store import PageStore
from libs.engine.radix_cache import RadixCache, Tier
from libs.prefix import block_hashes

log = logging.getLogger("moemesh.engine.store_tier")
PUBLISHED_MEMORY = 1 << 16  # names this worker put or fetched lately (not put again)
MIN_LOOKUP_PAGES = 2  # a request missing fewer pages recomputes them rather than wait for the store


@dataclass
class StoreCounters:
    hit_pages: int = 0  # fetched pages that entered the cache
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    fetches: int = 0
    published_pages: int = 0
    published_bytes: int = 0
    publish_skipped_pages: int = 0  # not published: tier down, host pool or in-flight budget full
    failures: int = 0  # store calls that failed or prefetches that timed out


@dataclass
class _Prefetch:
    rid: str
    tokens: list[int]
    hashes: list[int]
    start: int  # first page asked of the store
    deadline: float
    pages: list[int] = field(default_factory=list)  # host pages the fetch writes into
    cancelled: bool = False


class StoreTier:
    def __init__(
        self, store: PageStore, cache: RadixCache, namespace: str, *, timeout_s: float = 1.0,
        retry_s: float = 5.0, max_publish_pages: int = 1024, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if cache.host is None:
            raise ValueError("the store tier stages pages in the host tier: give the engine host KV pages")
        if not timeout_s > 0 or not retry_s > 0 or max_publish_pages < 1:
            raise ValueError("timeout_s and retry_s must be > 0 and max_publish_pages >= 1")
        self.store, self.cache, self.host = store, cache, cache.host
        self.namespace, self.timeout_s, self.retry_s = namespace, timeout_s, retry_s
        self.max_publish_pages, self.clock = max_publish_pages, clock
        self.counters = StoreCounters()
        self._pending: dict[str, _Prefetch] = {}
        self._publishing = 0  # host pages held by puts in flight
        self._fetching = 0  # host pages held by fetches in flight (given-up ones too: freed when they end)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._down_until = 0.0
        self._jobs: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._connected = False  # set by the thread
        # called on the store's thread when a result is ready for `poll` (it must not block nor call the tier)
        self.on_result: Callable[[], object] | None = None
        self._thread = threading.Thread(target=self._run, name="kv-store-tier", daemon=True)
        cache.hashing = True
        cache.on_stored = self.publish
        self._thread.start()

    # --- engine thread ---
    @property
    def available(self) -> bool:
        return self._connected and self.clock() >= self._down_until

    def name(self, block_hash: int) -> str:
        return f"{self.namespace}:{block_hash:016x}"

    def publish(self, hashes: list[int], device_pages: list[int]) -> None:
        """Write new cache pages through to the store (best effort: skipped when it cannot be done now)."""
        keep = [i for i, h in enumerate(hashes) if self.name(h) not in self._known]
        if not keep:
            return
        n = len(keep)
        if not self.available or self._publishing + n > self.max_publish_pages or not self._host_room(n):
            self.counters.publish_skipped_pages += n
            return
        host_pages = self.host.alloc(n)
        fence = self.host.to_host([device_pages[i] for i in keep], host_pages)
        names = [self.name(hashes[i]) for i in keep]
        for nm in names:
            self._remember(nm)
        self._publishing += n
        self._jobs.put(("put", [hashes[i] for i in keep], names, host_pages, fence))

    def prefetch(self, rid: str, tokens: Sequence[int]) -> bool:
        """Fetch the pages of `tokens` past the local cache that the store holds (one job: which exist, then
        those of the leading run, into host pages taken now); True while that runs (the request is not
        admitted until `pending(rid)` is False). Fewer than MIN_LOOKUP_PAGES to find: not worth a trip."""
        if not self.available or rid in self._pending:
            return False
        ps = self.cache.page_size
        start = self.cache.match_prefix(tokens).length // ps
        want = len(tokens) // ps - start
        if want < MIN_LOOKUP_PAGES:
            return False
        self._host_room(want)
        n = min(want, self.host.num_free)
        if n < MIN_LOOKUP_PAGES:
            return False
        hashes = block_hashes(tokens, ps)
        p = _Prefetch(rid, list(tokens), hashes, start, self.clock() + self.timeout_s, self.host.alloc(n))
        self._pending[rid] = p
        self._fetching += n
        names = [self.name(h) for h in hashes[start : start + n]]
        self._jobs.put(("fetch", p, names, [self.host.page_ptr(pg) for pg in p.pages]))
        return True

    def pending(self, rid: str) -> bool:
        return rid in self._pending

    @property
    def pages_in_flight(self) -> int:
        """Host pages the store thread still holds (puts and fetches, given-up fetches included)."""
        return self._publishing + self._fetching

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def cancel(self, rid: str) -> None:
        p = self._pending.pop(rid, None)
        if p is not None:
            p.cancelled = True

    def poll(self, block_s: float = 0.0) -> None:
        """Take the thread's results (waiting up to block_s for the first) and give up overdue prefetches."""
        try:
            item = self._done.get(timeout=block_s) if block_s > 0 else self._done.get_nowait()
            while True:
                self._handle(item)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        now = self.clock()
        for rid in [r for r, p in self._pending.items() if now > p.deadline]:
            self.cancel(rid)
            self._failed(f"prefetch of {rid!r} took over {self.timeout_s} s")

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread after the jobs queued (it leaves the store); wait up to `timeout` for it."""
        self._jobs.put(None)
        if timeout is not None:
            self._thread.join(timeout)

    # --- results (engine thread) ---
    def _handle(self, item: tuple) -> None:
        match item:
            case ("fetch", p, oks, seconds, error):
                self._fetch_done(p, oks, seconds, error)
            case ("put", hashes, names, host_pages, oks, error):
                self._put_done(hashes, names, host_pages, oks, error)

    def _fetch_done(self, p: _Prefetch, oks: list[bool], seconds: float, error: str) -> None:
        self._fetching -= len(p.pages)
        if error:
            self._failed(error)
        k = next((i for i, ok in enumerate(oks) if not ok), len(oks))
        self.counters.fetches += 1
        self.counters.fetch_seconds += seconds
        self.counters.fetched_bytes += k * self.host.page_bytes
        if p.cancelled:
            self.host.free(p.pages)
            return
        self._pending.pop(p.rid, None)
        used = self._insert(p, k)
        self.host.free([pg for i, pg in enumerate(p.pages) if i not in used])

    def _insert(self, p: _Prefetch, k: int) -> set[int]:
        """Fetched pages start..start+k as a host-tier node where the local cache now ends; the indexes of
        p.pages the cache took."""
        ps, end = self.cache.page_size, p.start + k
        m = self.cache.match_prefix(p.tokens[: end * ps])
        have = m.length // ps
        if not p.start <= have < end:  # the local prefix changed meanwhile: nothing to chain onto, or no need
            return set()
        used = range(have - p.start, k)
        self.cache.insert_host(
            m.node, p.tokens[have * ps : end * ps], [p.pages[i] for i in used], p.hashes[have:end]
        )
        for h in p.hashes[have:end]:
            self._remember(self.name(h))
        self.counters.hit_pages += len(used)
        return set(used)

    def _put_done(
        self, hashes: list[int], names: list[str], host_pages: list[int], oks: list[bool], error: str
    ) -> None:
        self._publishing -= len(host_pages)
        self.host.free(host_pages)
        if error:
            self._failed(error)
        done = [h for h, ok in zip(hashes, oks, strict=False) if ok]
        for nm, ok in zip(names, oks, strict=False):
            if not ok:
                self._known.pop(nm, None)
        self.counters.published_pages += len(done)
        self.counters.published_bytes += len(done) * self.host.page_bytes
        moved = getattr(self.cache.listener, "blocks_moved", None)
        if done and moved is not None:
            moved(done, int(Tier.STORE))

    def _failed(self, why: str) -> None:
        self.counters.failures += 1
        if self.clock() >= self._down_until:
            log.warning("KV store unavailable (%s): recomputing for %.0f s", why, self.retry_s)
        self._down_until = self.clock() + self.retry_s

    def _host_room(self, n: int) -> bool:
        if self.host.num_free < n:
            self.cache._evict_host(n - self.host.num_free)
        return self.host.num_free >= n

    def _remember(self, name: str) -> None:
        self._known[name] = None
        self._known.move_to_end(name)
        if len(self._known) > PUBLISHED_MEMORY:
            self._known.popitem(last=False)

    # --- the store's thread ---
    def _run(self) -> None:
        while not self._connect():
            if not self._fail_queued():  # closed meanwhile
                return
            time.sleep(self.retry_s)  # no store yet: try again later
        while (job := self._jobs.get()) is not None:
            try:
                self._result(self._do(job))
            except Exception as e:  # the engine hears it as a failure (the client recovers on its own)
                log.info("KV store call failed: %s", e)
                self._fail_job(job, str(e) or type(e).__name__)
        self.store.close()

    def _fail_queued(self) -> bool:
        """Answer every queued job as failed; False when close() was among them."""
        try:
            while (job := self._jobs.get_nowait()) is not None:
                self._fail_job(job, "not connected")
            return False
        except queue.Empty:
            return True

    def _connect(self) -> bool:
        try:
            self.store.connect()
            self.store.register(self.host.data_ptr(), self.host.nbytes)
        except Exception as e:
            log.warning("KV store not reachable: %s", e)
            return False
        self._connected = True
        return True

    def _do(self, job: tuple) -> tuple:
        size = self.host.page_bytes
        match job:
            case ("fetch", p, names, ptrs):
                t0 = time.perf_counter()
                if p.cancelled:  # given up on while queued: nothing to read
                    return ("fetch", p, [False] * len(names), 0.0, "")
                flags = self.store.exists(names)
                n = next((i for i, f in enumerate(flags) if not f), len(flags))
                oks = self.store.get_into(names[:n], ptrs[:n], size) if n else []
                return ("fetch", p, oks + [False] * (len(names) - len(oks)), time.perf_counter() - t0, "")
            case ("put", hashes, names, host_pages, fence):
                if fence is not None:
                    fence.synchronize()  # the device-to-host copy of these pages
                oks = self.store.put_from(names, [self.host.page_ptr(pg) for pg in host_pages], size)
                return ("put", hashes, names, host_pages, oks, "")
        raise ValueError(f"unknown store job {job[0]!r}")

    def _fail_job(self, job: tuple, why: str) -> None:
        match job:
            case ("fetch", p, names, _):
                self._result(("fetch", p, [False] * len(names), 0.0, why))
            case ("put", hashes, names, host_pages, fence):
                if fence is not None:
                    fence.synchronize()
                self._result(("put", hashes, names, host_pages, [False] * len(names), why))

    def _result(self, item: tuple) -> None:
        self._done.put(item)
        if (notify := self.on_result) is not None:
            try:
                notify()
            except Exception:  # the owner shutting down: the result waits for a poll that may never come
                log.debug("on_result failed", exc_info=True)


def stats_of(tier: StoreTier | None) -> dict[str, Any]:
    return {} if tier is None else dict(tier.counters.__dict__, up=tier.available)
