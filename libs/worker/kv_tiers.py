"""The worker side of the KV tiers: the shared store attached to the engine (Mooncake Store, its pages named
under a digest of the checkpoint and the KV layout), its results taken on the engine thread as they come back
(`StoreResults`), and the tiers' Prometheus metrics, read at scrape time from the engine's counters
(libs.engine.Engine.tier_stats)."""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.worker.engine_thread import EngineThread
from libs.worker.settings import WorkerSettings

log = logging.getLogger("moemesh.worker.kv_tiers")

_SAMPLE = 1 << 20  # bytes read from each end of every shard for the digest


def store_namespace(s: WorkerSettings, engine: Any) -> str:
    """kv_store_namespace, or a digest of what makes a page's bytes mean one thing: the checkpoint (its
    config and a sample of every shard's bytes), the stored row format, layers, row width and page size."""
    if s.kv_store_namespace:
        return s.kv_store_namespace
    h = hashlib.blake2b(digest_size=8)
    folder = Path(s.model_dir)
    h.update((folder / "config.json").read_bytes())
    for shard in sorted(folder.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(shard.name.encode() + size.to_bytes(8, "little"))
        with open(shard, "rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    pool = engine.kv_pool
    layout = f"{pool.format_name}/{pool.num_layers}x{pool.buffer.shape[-1]}/ps{pool.page_size}"
    h.update(layout.encode())
    return f"moemesh-kv-{h.hexdigest()}"


def attach_kv_store(engine: Any, s: WorkerSettings) -> None:
    """With kv_store_master set: the engine's pages shared through Mooncake Store (closed at exit)."""
    if not s.kv_store_master:
        return
    from libs.kvtransfer.mooncake_store import MooncakePageStore

    protocol = "rdma" if s.transfer_protocol == "rdma" else "tcp"  # host memory to host memory
    store = MooncakePageStore(
        s.kv_store_master,
        hostname=s.transfer_hostname,
        protocol=protocol,
        device=s.transfer_device,
        segment_bytes=s.kv_store_segment_mb << 20,
    )
    tier = engine.attach_store(
        store, store_namespace(s, engine), timeout_s=s.kv_store_timeout_s, retry_s=s.kv_store_retry_s
    )
    atexit.register(tier.close, 5.0)  # unmount from a live master before the interpreter tears down


class StoreResults:
    """Takes the store tier's results (puts and fetches done) on the engine thread as they come back, not only
    at the engine's next step: an idle worker would otherwise keep the host pages of its last puts, and report
    neither their bytes nor (on its KV events) that the store holds those blocks, until its next request."""

    def __init__(self, et: EngineThread, tier: Any) -> None:
        self.et, self.tier = et, tier
        self.loop = asyncio.get_running_loop()
        self._queued = False  # a poll is queued and not started yet (event loop only)
        self._tasks: set[asyncio.Task] = set()
        tier.on_result = self.notify

    def notify(self) -> None:
        """On the store's thread: a result is ready."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._queue)

    def _queue(self) -> None:
        if self._queued:  # the poll queued takes this result too
            return
        self._queued = True
        task = asyncio.create_task(self._poll())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll(self) -> None:
        self._queued = False  # a result from now on may come after this poll: it queues another
        try:
            await self.et.call(self.tier.poll)  # after_call publishes the KV events it produced
        except RuntimeError:  # the engine thread shut down (the worker stopping): nothing left to take
            log.debug("KV store results not taken", exc_info=True)
        except Exception:  # poll raises nothing by design; the next step polls again
            log.exception("taking the KV store's results failed")


def take_store_results(et: EngineThread) -> StoreResults | None:
    """With the shared store attached: its results taken as they come back (StoreResults), from now on."""
    tier = getattr(et.engine, "store_tier", None)
    return None if tier is None else StoreResults(et, tier)


class KvTierCollector(Collector):
    """Per-tier hits, bytes moved and load seconds, host pool pages, store health."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        st = self.engine.tier_stats()
        pages = self.engine.stats()
        hits = CounterMetricFamily(
            "moemesh_kv_tier_hit_pages", "Prefix pages served by tier", labels=["tier"]
        )
        for tier in ("device", "host", "store"):
            hits.add_metric([tier], st.get(f"{tier}_hit_pages", 0))
        yield hits
        moved = CounterMetricFamily(
            "moemesh_kv_tier_bytes", "KV bytes copied between tiers", labels=["direction"]
        )
        for label, key in (
            ("device_to_host", "offloaded_bytes"), ("host_to_device", "loaded_bytes"),
            ("store_to_host", "store_fetched_bytes"), ("host_to_store", "store_published_bytes"),
        ):  # fmt: skip
            moved.add_metric([label], st.get(key, 0))
        yield moved
        load = CounterMetricFamily(
            "moemesh_kv_tier_load_seconds", "Time spent bringing prefix pages in, by tier", labels=["tier"]
        )
        load.add_metric(["host"], st.get("host_load_seconds", 0.0))
        load.add_metric(["store"], st.get("store_fetch_seconds", 0.0))
        yield load
        host = GaugeMetricFamily("moemesh_kv_host_pages", "Host KV tier pages", labels=["state"])
        for state in ("total", "used", "cached"):
            host.add_metric([state], pages.get(f"host_{state}_pages", 0))
        yield host
        yield CounterMetricFamily(
            "moemesh_kv_host_dropped_pages",
            "Host-tier pages dropped to make room",
            value=st.get("host_dropped_pages", 0),
        )
        if "store_up" in st:
            yield GaugeMetricFamily(
                "moemesh_kv_store_up", "The shared KV store is in use (1) or down", value=st["store_up"]
            )
            yield CounterMetricFamily(
                "moemesh_kv_store_failures",
                "Shared KV store calls failed or timed out",
                value=st["store_failures"],
            )
            yield CounterMetricFamily(
                "moemesh_kv_store_publish_skipped_pages", "Pages not written through to the shared store",
                value=st["store_publish_skipped_pages"],
            )  # fmt: skip


def install_kv_tiers(engine: Any, s: WorkerSettings, registry: CollectorRegistry) -> None:
    """The store attached (if configured) and the tier metrics registered, for an engine with tiers."""
    if getattr(engine, "tier_stats", None) is None or getattr(engine, "host_pool", None) is None:
        return
    attach_kv_store(engine, s)
    registry.register(KvTierCollector(engine))
