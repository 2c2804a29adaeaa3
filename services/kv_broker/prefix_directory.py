"""The kv-broker's prefix directory: a PrefixReplica (libs/prefix/replica.py) that also answers PrefixQuery on
BROKER_PREFIX (queue group QUEUE_BROKER) for schedulers with prefix_index=broker, and says which workers are
live (heard within dead_after_intervals of their heartbeat interval)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from libs.bus import Bus
from libs.prefix.replica import PrefixReplica
from proto import messages as m
from proto import subjects


class PrefixDirectory(PrefixReplica):
    def __init__(self, bus: Bus, registry: CollectorRegistry, **kw) -> None:
        super().__init__(bus, registry, "moemesh_kv_broker_prefix", **kw)
        self.m_queries = Counter(
            "moemesh_kv_broker_prefix_queries", "Prefix overlap queries", registry=registry
        )
        self._heard: dict[str, float] = {}  # worker id -> when it stops counting as live (self.clock)

    async def on_heartbeat(self, hb: m.Heartbeat) -> None:
        match hb:
            case m.WorkerHeartbeat(worker_id=wid, interval_ms=ms):
                self._heard[wid] = self.clock() + self.index.dead_after_intervals * ms / 1000
            case m.WorkerGone(worker_id=wid):
                self._heard.pop(wid, None)
        await super().on_heartbeat(hb)

    def is_live(self, worker_id: str) -> bool:
        return self._heard.get(worker_id, float("-inf")) > self.clock()

    async def start(self, heartbeats: bool = True) -> None:
        await super().start(heartbeats)
        await self.bus.subscribe(
            subjects.BROKER_PREFIX, m.PrefixQuery, self.on_query, queue=subjects.QUEUE_BROKER
        )
        await self.bus.flush()  # subscribed at the server before the broker says it is started

    async def on_query(self, q: m.PrefixQuery) -> m.PrefixReply:
        if q.page_size < 1:
            raise ValueError(f"PrefixQuery.page_size must be >= 1, got {q.page_size}")
        self.m_queries.inc()
        ps = q.page_size
        tiers = self.index.tiered_overlap(q.hashes) if self.index.has_tiers else {}
        return m.PrefixReply(
            cached_tokens={w: n * ps for w, n in self.index.overlap(q.hashes).items()},
            tiers={w: [d * ps, h * ps, s * ps] for w, (d, h, s) in tiers.items()},
        )
