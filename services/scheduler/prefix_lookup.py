"""The scheduler's side of prefix-aware routing: how much of a prompt each worker already caches, from the
scheduler's own replica of the prefix index (or, with prefix_index=broker, the kv-broker's), plus the
prefixes this scheduler itself just sent to prefill workers. An unanswered broker query means no hits."""

# The replica (libs/prefix/replica.py) is fed by the workers' KV events and resynced from their snapshots on
# a gap: no bus round trip per placement. The broker is asked with PrefixQuery on BROKER_PREFIX, with a
# short timeout so placement never stalls on it (the request is placed on load alone).
#
# The prompt is hashed here (libs.prefix, once per page size the live workers use). The last prompt token
# is left out: an engine always computes it, so it is never a hit. Lookups are counted in
# `moemesh_scheduler_prefix_queries_total{outcome}` (local, ok, failed).
#
# Tiers: a worker's leading run can lie partly on its host tier, and a worker that reads the shared store
# can fetch the blocks after its run that the store holds; such blocks count `tier_weights` of a device
# block (host > store > 0: any hit beats recomputing). Without any, hits are the plain run, as before.
#
# Why `RecentPlacements`: a worker reports a prompt's blocks once its prefill has finished, so a burst of
# requests sharing a new prefix would find nothing in the index and spread over every prefill worker, each
# computing the prefix again. A placement is a promise that the blocks are coming (the worker runs its
# prompts in order, so a follow-up queued behind finds them cached); for `ttl_s` it counts as a hit, as
# SGLang's router counts a prompt in its tree from the moment it routes it.

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from libs.bus import Bus
from libs.prefix import block_hashes, leading, tier_weighted
from libs.prefix.replica import PrefixReplica
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.scheduler.prefix")


class RecentPlacements:
    """Block hashes of prompts recently placed on prefill workers, each valid for `ttl_s` (pure: the
    caller passes monotonic `now`)."""

    def __init__(self, ttl_s: float) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._until: dict[int, dict[str, float]] = {}  # hash -> worker -> expiry
        self._order: deque[tuple[float, int, str]] = deque()  # expiries in time order, for pruning

    def __len__(self) -> int:
        return sum(len(ws) for ws in self._until.values())

    def note(self, hashes: Sequence[int], worker: str, now: float) -> None:
        if self.ttl_s == 0:
            return
        self._prune(now)
        until = now + self.ttl_s
        for h in hashes:
            self._until.setdefault(h, {})[worker] = until
            self._order.append((until, h, worker))

    def overlap(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Worker -> leading blocks of `hashes` placed on it within the last ttl_s."""
        self._prune(now)
        return leading(hashes, self._until)

    def _prune(self, now: float) -> None:
        while self._order and self._order[0][0] < now:
            until, h, w = self._order.popleft()
            ws = self._until.get(h)
            if ws is not None and ws.get(w) == until:  # not renewed by a later placement
                del ws[w]
                if not ws:
                    del self._until[h]


class PrefixClient:
    def __init__(
        self,
        bus: Bus,
        registry: CollectorRegistry,
        timeout_s: float,
        pending_ttl_s: float = 5.0,
        clock=time.monotonic,
        replica: PrefixReplica | None = None,
        tier_weights: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """replica: the local prefix index to read; None asks the kv-broker on every lookup. tier_weights:
        what a host and a store block count, of a device block (libs.prefix.tier_weighted)."""
        if not timeout_s > 0:
            raise ValueError(f"prefix query timeout must be > 0, got {timeout_s}")
        self.bus, self.timeout_s, self.clock, self.replica = bus, timeout_s, clock, replica
        self.host_weight, self.store_weight = tier_weights
        self.recent = RecentPlacements(pending_ttl_s)
        self._last: tuple[Sequence[int], dict[int, list[int]]] | None = None  # the last prompt's hashes
        self.m_queries = Counter(
            "moemesh_scheduler_prefix_queries", "Prefix overlap queries to the kv-broker, by outcome",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self._local = self.m_queries.labels("local")  # bound once: no label lookup per placement
        self.m_seconds = Histogram(
            "moemesh_scheduler_prefix_query_seconds", "Prefix overlap query round trip",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=registry,
        )  # fmt: skip

    def _hashes(self, prompt_ids: Sequence[int], page_size: int) -> list[int]:
        if self._last is None or self._last[0] is not prompt_ids:
            self._last = (prompt_ids, {})
        by_size = self._last[1]
        if page_size not in by_size:
            by_size[page_size] = block_hashes(prompt_ids[:-1], page_size)
        return by_size[page_size]

    async def hits(self, prompt_ids: Sequence[int], page_sizes: Iterable[int]) -> dict[str, int]:
        """Worker id -> cached prompt tokens (index or recent placements); {} when nothing is known."""
        out: dict[str, int] = {}
        for page_size in sorted(set(page_sizes)):
            hashes = self._hashes(prompt_ids, page_size)
            if not hashes:
                continue
            recent = self.recent.overlap(hashes, self.clock())
            if self.replica is not None and self.replica.index.has_tiers:
                self._local.inc()
                found = self._weighted(self.replica.index.tiered_overlap(hashes), page_size)
                for wid, n in recent.items():
                    found[wid] = max(found.get(wid, 0), n * page_size)
            elif self.replica is not None:
                self._local.inc()
                blocks = self.replica.index.overlap(hashes)  # a fresh dict: merged into in place
                for wid, n in recent.items():
                    if n > blocks.get(wid, 0):
                        blocks[wid] = n
                found = {wid: n * page_size for wid, n in blocks.items()}
            else:
                found = await self._ask_broker(page_size, hashes)
                for wid, n in recent.items():
                    found[wid] = max(found.get(wid, 0), n * page_size)
            if not out:
                out = found
                continue
            for wid, n in found.items():
                if n > out.get(wid, 0):
                    out[wid] = n
        return out

    async def _ask_broker(self, page_size: int, hashes: list[int]) -> dict[str, int]:
        t0 = time.perf_counter()
        try:
            reply: m.PrefixReply = await self.bus.request(
                subjects.BROKER_PREFIX,
                m.PrefixQuery(page_size=page_size, hashes=hashes),
                m.PrefixReply,
                timeout=self.timeout_s,
            )
        except Exception as e:  # timeout, no broker, refusal: place on what is known locally
            self.m_queries.labels("failed").inc()
            log.debug("prefix query failed, placing without the index: %s", e)
            return {}
        self.m_seconds.observe(time.perf_counter() - t0)
        self.m_queries.labels("ok").inc()
        if reply.tiers:
            return self._weighted({w: (d // page_size, h // page_size, s // page_size)
                                   for w, (d, h, s) in reply.tiers.items()}, page_size)  # fmt: skip
        return dict(reply.cached_tokens)

    def _weighted(self, tiers: dict[str, tuple[int, int, int]], page_size: int) -> dict[str, int]:
        """Worker -> the device tokens its (device, host, store) blocks are worth to placement."""
        hw, sw = self.host_weight, self.store_weight
        return {wid: tier_weighted(b, page_size, hw, sw) for wid, b in tiers.items()}

    def placed(self, prompt_ids: Sequence[int], prefill_worker: str, page_size: int) -> None:
        """The prompt was just sent to `prefill_worker`: its blocks will be there."""
        self.recent.note(self._hashes(prompt_ids, page_size), prefill_worker, self.clock())
