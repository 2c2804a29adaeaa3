"""EPLB: balanced packing, replication of hot experts, hierarchical/global placement (pure)."""

from __future__ import annotations

import pytest
import torch

from libs.ep import eplb
from libs.ep.placement import Placement


def skewed_load(layers: int, experts: int, s: float = 1.2, seed: int = 0) -> torch.Tensor:
    """Zipf-like tokens per expert (a few hot experts), a different hot set per layer."""
    gen = torch.Generator().manual_seed(seed)
    base = 10_000 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    return torch.stack([base[torch.randperm(experts, generator=gen)].round() for _ in range(layers)])


def test_balanced_packing_fills_every_pack_equally_and_balances_weight() -> None:
    weights = [9, 8, 7, 6, 5, 4, 3, 2]
    pack, pos = eplb.balanced_packing(weights, 2)
    assert sorted(pack) == [0, 0, 0, 0, 1, 1, 1, 1]
    sums = [sum(w for w, p in zip(weights, pack, strict=True) if p == k) for k in (0, 1)]
    assert sums == [22, 22]
    assert sorted((p, q) for p, q in zip(pack, pos, strict=True)) == [
        (p, q) for p in (0, 1) for q in range(4)
    ]
    with pytest.raises(ValueError, match="equal packs"):
        eplb.balanced_packing([1, 2, 3], 2)


def test_replicate_gives_extra_copies_to_the_largest_load_per_copy() -> None:
    slot_item, copies = eplb.replicate([100, 10, 40], 6)
    # per-copy loads 100, 10, 40 -> copy 0 (50 each) -> copy 0 again (50 > 40; 33 each) -> copy 2 (40 > 33)
    assert slot_item == [0, 1, 2, 0, 0, 2] and copies == [3, 1, 2]
    with pytest.raises(ValueError, match="cannot hold"):
        eplb.replicate([1, 2, 3], 2)


def test_replicate_order_follows_per_copy_load() -> None:
    slot_item, copies = eplb.replicate([100, 10, 60], 6)
    # per copy: 100 -> (50) -> 60 next -> 50 vs 30 -> 100/3=33 vs 30
    assert slot_item[3:] == [0, 2, 0] and copies == [3, 1, 2]


@pytest.mark.parametrize(
    ("experts", "groups", "ranks", "redundant", "nodes"),
    [(16, 4, 4, 4, 1), (64, 8, 8, 8, 1), (64, 8, 8, 8, 2), (16, 1, 4, 0, 1)],
)
def test_rebalance_returns_a_valid_placement(experts, groups, ranks, redundant, nodes) -> None:
    load = skewed_load(3, experts)
    p = eplb.rebalance(load, experts + redundant, ranks, num_groups=groups, num_nodes=nodes)
    assert isinstance(p, Placement) and p.num_physical == experts + redundant and p.ep_size == ranks
    hottest = load.argmax(1, keepdim=True)  # [L, 1]
    assert (p.logcnt.gather(1, hottest).squeeze(1) == p.logcnt.amax(1)).all()  # most copies to the hottest


def test_hierarchical_keeps_each_expert_group_on_one_node() -> None:
    experts, groups, ranks, nodes = 64, 8, 8, 2
    p = eplb.rebalance(skewed_load(2, experts), experts + 8, ranks, num_groups=groups, num_nodes=nodes)
    half = p.num_physical // nodes
    for layer in p.phy2log:
        node_groups = [
            set((layer[n * half : (n + 1) * half] // (experts // groups)).tolist()) for n in range(2)
        ]
        assert not node_groups[0] & node_groups[1]
        assert len(node_groups[0]) == len(node_groups[1]) == groups // nodes


def test_groups_that_do_not_divide_over_nodes_fall_back_to_global_balancing() -> None:
    load = skewed_load(2, 12)
    p = eplb.rebalance(load, 16, 4, num_groups=3, num_nodes=2)
    assert p == eplb.rebalance(load, 16, 4, num_groups=1, num_nodes=1)


@pytest.mark.parametrize(
    ("experts", "groups", "ranks", "redundant"), [(16, 4, 4, 4), (64, 8, 8, 8), (256, 8, 32, 32)]
)
def test_eplb_lowers_the_max_over_mean_rank_load_on_a_skewed_load(experts, groups, ranks, redundant) -> None:
    load = skewed_load(4, experts)
    before = Placement.uniform(4, experts, ranks, redundant).imbalance(load)
    after_p = eplb.rebalance(load, experts + redundant, ranks, num_groups=groups)
    after = after_p.imbalance(load)
    print(f"E={experts} ranks={ranks} redundant={redundant}: max/mean rank load {before:.3f} -> {after:.3f}")
    assert after < before and after < 1.1


def test_bad_inputs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="divisible by ep_size"):
        eplb.rebalance(torch.ones(1, 16), 18, 4)
    with pytest.raises(ValueError, match="negative"):
        eplb.rebalance(-torch.ones(1, 16), 16, 4)
    with pytest.raises(ValueError, match="groups"):
        eplb.rebalance(torch.ones(1, 16), 16, 4, num_groups=5)
    with pytest.raises(ValueError, match="layers, experts"):
        eplb.rebalance(torch.ones(16), 16, 4)
