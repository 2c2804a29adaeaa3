"""EPLB: a new expert placement from the expert load counted since the last one, as DeepSeek's
expert-parallel load balancer (`rebalance_experts`) does. Pure functions of numbers: no devices, no
communication."""

# Legend: L MoE layers, E logical experts, P physical slots, G expert groups, N EP ranks (GPUs), M nodes.
# Hierarchical when the node count divides the group count: pack whole groups onto nodes (group-limited
# routing stays inside few nodes), replicate the heaviest experts within each node, pack onto its ranks;
# global otherwise. Replication gives one more copy to the expert with the largest per-copy load until every
# slot is used; packing is greedy longest-processing-time with the same number of items per pack.

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.ep.placement import Placement


def balanced_packing(weights: Sequence[float], num_packs: int) -> tuple[list[int], list[int]]:
    """-> (pack of each item, its position inside the pack); len(weights) must divide into num_packs."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not divide into {num_packs} equal packs")
    per_pack = n // num_packs
    pack_of, slot_of = [0] * n, [0] * n
    loads, sizes = [0.0] * num_packs, [0] * num_packs
    for item in sorted(range(n), key=lambda i: (-weights[i], i)):
        pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: (loads[p], p))
        pack_of[item], slot_of[item] = pack, sizes[pack]
        loads[pack] += weights[item]
        sizes[pack] += 1
    return pack_of, slot_of


def replicate(weights: Sequence[float], num_slots: int) -> tuple[list[int], list[int]]:
    """One slot per item, then each extra slot to the item with the largest load per copy.
    -> (item in each slot, copies of each item)."""
    n = len(weights)
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    slot_item, copies = list(range(n)), [1] * n
    for _ in range(num_slots - n):
        best = max(range(n), key=lambda i: (weights[i] / copies[i], -i))
        slot_item.append(best)
        copies[best] += 1
    return slot_item, copies


def _place_on_ranks(weights: Sequence[float], experts: Sequence[int], num_slots: int, num_ranks: int) -> list:
    """Replicate `experts` (their loads in `weights`) over num_slots, pack onto num_ranks ranks.
    -> [num_ranks][num_slots / num_ranks] logical expert per slot."""
    local = [weights[e] for e in experts]
    slot_item, copies = replicate(local, num_slots)
    per_copy = [local[i] / copies[i] for i in slot_item]
    pack_of, slot_of = balanced_packing(per_copy, num_ranks)
    ranks = [[0] * (num_slots // num_ranks) for _ in range(num_ranks)]
    for slot, item in enumerate(slot_item):
        ranks[pack_of[slot]][slot_of[slot]] = experts[item]
    return ranks


def rebalance_layer(
    weights: Sequence[float], num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> list[int]:
    """One layer's phy2log [P] (hierarchical; pass num_groups = num_nodes = 1 for the global policy)."""
    num_logical = len(weights)
    group_size = num_logical // num_groups
    group_load = [sum(weights[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of, _ = balanced_packing(group_load, num_nodes)
    row: list[int] = []
    for node in range(num_nodes):
        experts = [
            g * group_size + i for g in range(num_groups) if node_of[g] == node for i in range(group_size)
        ]
        ranks = _place_on_ranks(weights, experts, num_physical // num_nodes, num_ranks // num_nodes)
        row += [e for rank in ranks for e in rank]
    return row


def rebalance(
    load: torch.Tensor | Sequence[Sequence[float]],
    num_physical: int,
    ep_size: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> Placement:
    """load [L, E] tokens per logical expert per MoE layer -> a Placement of num_physical slots on ep_size
    ranks. Hierarchical when num_nodes divides num_groups, else global. ValueError on shapes that cannot work."""
    load_t = torch.as_tensor(load, dtype=torch.float64)
    if load_t.dim() != 2 or load_t.shape[1] == 0:
        raise ValueError(f"load must be [layers, experts], got shape {tuple(load_t.shape)}")
    if bool((load_t < 0).any()):
        raise ValueError("expert load cannot be negative")
    num_logical = load_t.shape[1]
    if num_physical < num_logical or num_physical % ep_size:
        raise ValueError(
            f"num_physical {num_physical} must be >= {num_logical} experts and divisible by ep_size {ep_size}"
        )
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"{num_logical} experts do not split into {num_groups} groups")
    if num_nodes < 1 or ep_size % num_nodes or num_physical % num_nodes:
        raise ValueError(f"{ep_size} ranks / {num_physical} slots do not split over {num_nodes} nodes")
    if num_groups % num_nodes:  # groups cannot stay whole on nodes: balance globally
        num_groups, num_nodes = 1, 1
    rows = [rebalance_layer(layer, num_physical, num_groups, num_nodes, ep_size) for layer in load_t.tolist()]
    return Placement(rows, num_logical, ep_size)
