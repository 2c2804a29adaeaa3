"""Placement: the logical -> physical table every rank of an EP group shares (pure)."""

from __future__ import annotations

import pytest
import torch

from libs.ep.placement import Placement


def test_uniform_placement_without_redundancy_gives_each_rank_a_contiguous_block() -> None:
    p = Placement.uniform(num_layers=2, num_logical=16, ep_size=4)
    assert (p.num_physical, p.slots_per_rank) == (16, 4)
    assert p.local_experts(1).tolist() == [[4, 5, 6, 7]] * 2
    assert p.logcnt.tolist() == [[1] * 16] * 2
    assert p.log2phy[0, 5].tolist() == [5]


def test_redundant_slots_copy_experts_and_the_inverse_table_lists_every_copy() -> None:
    p = Placement.uniform(num_layers=1, num_logical=16, ep_size=2, num_redundant=2)
    assert p.num_physical == 18 and p.slots_per_rank == 9
    assert p.local_experts(1).tolist() == [[9, 10, 11, 12, 13, 14, 15, 0, 1]]
    assert p.logcnt[0, :3].tolist() == [2, 2, 1]
    assert p.log2phy[0, 0].tolist() == [0, 16] and p.log2phy[0, 2].tolist() == [2, -1]


@pytest.mark.parametrize(
    ("phy2log", "num_logical", "ep_size", "match"),
    [
        ([[0, 1, 2]], 3, 2, "do not divide"),
        ([[0, 1, 1, 1]], 3, 2, "expert 2 has no physical slot"),
        ([[0, 1, 2, 7]], 4, 2, "outside 0..3"),
        ([[0, 1]], 4, 2, "cannot hold 4"),
        ([0, 1], 2, 1, "must be \\[layers, physical slots\\]"),
    ],
)
def test_invalid_tables_are_refused_with_the_reason(phy2log, num_logical, ep_size, match) -> None:
    with pytest.raises(ValueError, match=match):
        Placement(phy2log, num_logical, ep_size)


def test_to_physical_picks_a_copy_of_the_chosen_expert_and_spreads_tokens_over_copies() -> None:
    p = Placement([[0, 1, 2, 3, 0, 0]], num_logical=4, ep_size=2)  # expert 0 has three copies
    ids = torch.tensor([[0, 1]] * 6)
    slots = p.to_physical(0, ids, rank=1)
    assert (p.phy2log[0][slots] == ids).all()
    assert sorted(slots[:, 0].tolist()) == [0, 0, 4, 4, 5, 5]  # even split over the copies
    assert slots[:, 1].tolist() == [1] * 6


def test_rank_loads_split_an_experts_load_over_its_copies() -> None:
    p = Placement([[0, 1, 0, 2]], num_logical=3, ep_size=2)
    loads = p.rank_loads(torch.tensor([[10.0, 4.0, 6.0]]))
    assert loads.tolist() == [[9.0, 11.0]]  # rank 0: 10/2 + 4, rank 1: 10/2 + 6
    assert p.imbalance(torch.tensor([[10.0, 4.0, 6.0]])) == pytest.approx(11 / 10)
    with pytest.raises(ValueError, match="load must be"):
        p.rank_loads(torch.zeros(2, 3))


def test_wire_round_trip_and_equality() -> None:
    p = Placement.uniform(3, 8, 4, num_redundant=4)
    q = Placement.from_wire(p.to_wire())
    assert q == p and q.log2phy.equal(p.log2phy)
    assert q != Placement.uniform(3, 8, 4, num_redundant=0)
