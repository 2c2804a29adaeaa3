"""Rank choice inside an EP group and the merged prefix-cache events (pure)."""

from __future__ import annotations

from libs.ep.rank_routing import RankBlocks, pick_rank
from tests.libs.cache_recorder import Recorder


def test_least_busy_rank_wins_without_a_cached_prefix() -> None:
    assert pick_rank(busy=[3, 1, 2], free=[9, 9, 9], matched=[0, 0, 0], slack=2) == 1
    assert pick_rank(busy=[1, 1], free=[5, 9], matched=[0, 0], slack=2) == 1  # then more free pages
    assert pick_rank(busy=[1, 1], free=[9, 9], matched=[0, 0], slack=2) == 0  # then the lower rank


def test_the_rank_with_the_prefix_wins_unless_it_is_too_busy() -> None:
    assert pick_rank(busy=[2, 0], free=[9, 9], matched=[4, 0], slack=2) == 0
    assert pick_rank(busy=[3, 0], free=[9, 9], matched=[4, 0], slack=2) == 1


def test_merged_events_report_a_block_once_while_any_rank_holds_it() -> None:
    blocks, rec = RankBlocks(2), Recorder()
    blocks.apply(0, [(True, [1, 2])])
    blocks.set_listener(rec)  # what is cached already is reported first
    blocks.apply(1, [(True, [1, 3])])
    blocks.apply(0, [(False, [1, 2])])
    blocks.apply(1, [(False, [1])])
    assert rec.events == [("stored", [1, 2]), ("stored", [3]), ("removed", [2]), ("removed", [1])]
    assert blocks.matched([3, 9]) == [0, 1] and blocks.matched([1]) == [0, 0]


def test_matched_counts_only_an_unbroken_prefix() -> None:
    blocks = RankBlocks(2)
    blocks.apply(0, [(True, [10, 11, 13])])
    blocks.apply(1, [(True, [10])])
    assert blocks.matched([10, 11, 12, 13]) == [2, 1]
