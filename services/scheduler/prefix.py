"""The scheduler's side of prefix-aware routing: how much of a prompt each worker already caches, asked
of the kv-broker's prefix index (PrefixQuery on proto.subjects.BROKER_PREFIX).

The prompt is hashed here (libs.prefix, once per page size the live workers use) and only the hashes
travel. The last prompt token is left out: an engine always computes it, so it is never a hit. Placement
must not stall on the index: a query has a short timeout, and an unanswered one means no hits (the
request is placed on load alone), counted in `moemesh_scheduler_prefix_queries_total{outcome}`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from libs.bus import Bus
from libs.prefix import block_hashes
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.scheduler.prefix")


class PrefixClient:
    def __init__(self, bus: Bus, registry: CollectorRegistry, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"prefix query timeout must be > 0, got {timeout_s}")
        self.bus, self.timeout_s = bus, timeout_s
        self.m_queries = Counter(
            "moemesh_scheduler_prefix_queries", "Prefix overlap queries to the kv-broker, by outcome",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.m_seconds = Histogram(
            "moemesh_scheduler_prefix_query_seconds", "Prefix overlap query round trip",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=registry,
        )  # fmt: skip

    async def hits(self, prompt_ids: Sequence[int], page_sizes: Iterable[int]) -> dict[str, int]:
        """Worker id -> cached prompt tokens; {} when nothing is cached or the broker does not answer."""
        out: dict[str, int] = {}
        for page_size in sorted(set(page_sizes)):
            hashes = block_hashes(prompt_ids[:-1], page_size)
            if not hashes:
                continue
            t0 = time.perf_counter()
            try:
                reply = await self.bus.request(
                    subjects.BROKER_PREFIX,
                    m.PrefixQuery(page_size=page_size, hashes=hashes),
                    m.PrefixReply,
                    timeout=self.timeout_s,
                )
            except Exception as e:  # timeout, no broker, refusal: place on load alone
                self.m_queries.labels("failed").inc()
                log.debug("prefix query failed, placing without cache hits: %s", e)
                continue
            self.m_seconds.observe(time.perf_counter() - t0)
            self.m_queries.labels("ok").inc()
            for wid, n in reply.cached_tokens.items():
                out[wid] = max(out.get(wid, 0), n)
        return out
