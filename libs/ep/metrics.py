"""Prometheus view of an EP group: tokens per logical expert per layer, the rank imbalance the current
placement gives on the load since it was applied, and how many times EPLB changed the placement."""

# A custom collector reads the front's counters at scrape time: no per-step metric updates on the engine
# thread (a scrape may see one step's load half-added, which a counter tolerates).

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class ExpertLoadCollector(Collector):
    def __init__(self, engine: Any) -> None:
        self.engine = engine  # libs.ep.engine.EPEngine

    def collect(self) -> Iterator[Any]:
        e = self.engine
        load = CounterMetricFamily(
            "moemesh_expert_load_tokens", "tokens routed to each logical expert", labels=["layer", "expert"]
        )
        totals = e.expert_load.copy()
        for j, layer in enumerate(e.layer_ids):
            for expert, n in enumerate(totals[j].tolist()):
                load.add_metric([str(layer), str(expert)], n)
        yield load
        window = e.window_load.copy()
        imbalance = GaugeMetricFamily(
            "moemesh_ep_load_imbalance",
            "max/mean tokens per EP rank under the current placement, since it was applied (1 = balanced)",
        )
        imbalance.add_metric([], e.placement.imbalance(window))
        yield imbalance
        rebalances = CounterMetricFamily("moemesh_eplb_rebalances", "placement changes applied by EPLB")
        rebalances.add_metric([], e.num_rebalances)
        yield rebalances
        ranks = GaugeMetricFamily("moemesh_ep_ranks", "ranks in this worker's EP group")
        ranks.add_metric([], e.ep_size)
        yield ranks
