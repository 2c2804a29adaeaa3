"""The EP group's Prometheus collector reads the front's counters at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from libs.ep.metrics import ExpertLoadCollector
from libs.ep.placement import Placement


def test_expert_load_imbalance_and_rebalances_are_exported() -> None:
    engine = SimpleNamespace(
        expert_load=np.array([[5, 0, 1, 2], [0, 0, 0, 7]]),
        window_load=np.array([[3, 0, 0, 1], [0, 0, 0, 0]]),
        layer_ids=[1, 2],
        placement=Placement.uniform(2, 4, 2),
        num_rebalances=3,
        ep_size=2,
    )
    registry = CollectorRegistry()
    registry.register(ExpertLoadCollector(engine))
    text = generate_latest(registry).decode()
    assert 'moemesh_expert_load_tokens_total{expert="0",layer="1"} 5.0' in text
    assert 'moemesh_expert_load_tokens_total{expert="3",layer="2"} 7.0' in text
    # layer 1 window: rank 0 holds experts 0,1 (3 tokens), rank 1 experts 2,3 (1): max/mean = 3/2; layer 2 idle
    assert "moemesh_ep_load_imbalance 1.5" in text
    assert "moemesh_eplb_rebalances_total 3.0" in text and "moemesh_ep_ranks 2.0" in text
