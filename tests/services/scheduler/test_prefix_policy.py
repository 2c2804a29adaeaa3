"""Cache-aware placement, pure: cached tokens weighed against load, load-only when the weight is 0, and
the decode worker's cached length in the direct-prefill decision."""

from __future__ import annotations

import pytest

from proto.messages import Role
from services.scheduler.policy import Plan, PlanKind, PolicyConfig, placement_score, schedule
from tests.services.scheduler.factories import make_heartbeat, make_request, make_workers

AWARE = PolicyConfig(direct_prefill_threshold=0, prefix_weight=2.0)
LOAD_ONLY = PolicyConfig(direct_prefill_threshold=0, prefix_weight=0.0)


def plan(table, hits, cfg=AWARE, prompt_len=100) -> Plan:
    d = schedule(table.live(0.0), make_request(prompt_len=prompt_len), cfg, hits)
    assert isinstance(d, Plan), d
    return d


def two_prefill(p0_waiting: int = 0, p1_waiting: int = 0):
    return make_workers(
        make_heartbeat("d0"),
        make_heartbeat("p0", Role.PREFILL, waiting=p0_waiting),
        make_heartbeat("p1", Role.PREFILL, waiting=p1_waiting),
    )


def test_score_is_the_weighted_cached_share_minus_load() -> None:
    assert placement_score(load=0, cached_tokens=100, prompt_len=100, prefix_weight=2.0) == 2.0
    assert placement_score(load=3, cached_tokens=50, prompt_len=100, prefix_weight=2.0) == -2.0
    assert placement_score(load=1, cached_tokens=500, prompt_len=100, prefix_weight=2.0) == 1.0  # capped
    assert placement_score(load=1, cached_tokens=80, prompt_len=100, prefix_weight=0.0) == -1.0


@pytest.mark.parametrize(
    "p1_waiting, cached, winner",
    [
        (0, 80, "p1"),  # equal load: the cache decides
        (1, 80, "p1"),  # 1.6 of cache value beats 1 request of extra load
        (1, 40, "p0"),  # 0.8 does not
        (2, 96, "p0"),  # 2 requests more load outweigh even a near-full hit (1.92)
    ],
)
def test_cached_tokens_are_weighed_against_load(p1_waiting: int, cached: int, winner: str) -> None:
    d = plan(two_prefill(p1_waiting=p1_waiting), {"p1": cached})
    assert d.prefill == winner
    assert d.uncached == 100 - (cached if winner == "p1" else 0)


def test_a_larger_weight_lets_the_cache_tolerate_more_imbalance() -> None:
    heavy = PolicyConfig(direct_prefill_threshold=0, prefix_weight=8.0)
    assert plan(two_prefill(p1_waiting=3), {"p1": 50}, heavy).prefill == "p1"  # 4 > 3
    assert plan(two_prefill(p1_waiting=5), {"p1": 50}, heavy).prefill == "p0"  # 4 < 5


def test_placements_since_the_last_heartbeat_count_against_the_cached_worker() -> None:
    table = two_prefill()
    hits = {"p1": 90}
    assert plan(table, hits).prefill == "p1"
    table.note_placement("p1")
    assert plan(table, hits).prefill == "p1"  # 1.8 - 1 > 0
    table.note_placement("p1")
    assert plan(table, hits).prefill == "p0"  # 1.8 - 2 < 0: spill over to the idle worker


def test_weight_zero_is_load_only_placement() -> None:
    assert plan(two_prefill(), {"p1": 99}, LOAD_ONLY).prefill == "p0"  # not even a tie-breaker
    assert plan(two_prefill(p0_waiting=1), {"p0": 99}, LOAD_ONLY).prefill == "p1"
    d = plan(two_prefill(), {"p1": 99}, LOAD_ONLY)
    assert d.uncached == 100  # what p0 must compute: it holds nothing


def test_decode_choice_follows_the_prefix_so_a_follow_up_turn_finds_its_kv() -> None:
    table = make_workers(
        make_heartbeat("d0", free_pages=64),
        make_heartbeat("d1", free_pages=40),
        make_heartbeat("p0", Role.PREFILL),
    )
    assert plan(table, {}).decode == "d0"  # most free pages
    assert plan(table, {"d1": 64}).decode == "d1"  # the cache outweighs free pages at equal load
    busy = make_workers(
        make_heartbeat("d0"), make_heartbeat("d1", running=3), make_heartbeat("p0", Role.PREFILL)
    )
    assert plan(busy, {"d1": 64}).decode == "d0"  # 3 running > 1.28 of cache value
    assert plan(table, {"d1": 64}, LOAD_ONLY).decode == "d0"


def test_direct_prefill_counts_only_what_the_chosen_decode_worker_lacks() -> None:
    cfg = PolicyConfig(direct_prefill_threshold=32, prefix_weight=2.0)
    table = make_workers(make_heartbeat("d0"), make_heartbeat("d1"), make_heartbeat("p0", Role.PREFILL))
    d = plan(table, {"d1": 80}, cfg)  # d1 is chosen for its cache; 20 uncached tokens <= 32
    assert (d.kind, d.decode, d.prefill, d.uncached) == (PlanKind.DIRECT, "d1", None, 20)
    d = plan(table, {"d1": 80}, PolicyConfig(direct_prefill_threshold=32, prefix_weight=0.0))
    assert (d.kind, d.decode, d.prefill) == (PlanKind.DISAGGREGATED, "d0", "p0")  # d0 lacks all 100
    d = plan(table, {"d1": 64}, cfg)  # 36 uncached > 32: prefilled elsewhere, decoded where the KV is
    assert (d.kind, d.decode, d.prefill, d.uncached) == (PlanKind.DISAGGREGATED, "d1", "p0", 100)


@pytest.mark.parametrize("weight", [-1.0, float("inf"), float("nan")])
def test_bad_weight_is_a_clear_error(weight: float) -> None:
    with pytest.raises(ValueError, match="prefix_weight"):
        PolicyConfig(prefix_weight=weight)


# --- the scheduler's own recent placements -----------------------------------------------------------


def test_recent_placements_count_as_leading_blocks_until_they_expire() -> None:
    from services.scheduler.prefix_lookup import RecentPlacements

    recent = RecentPlacements(ttl_s=5.0)
    recent.note([1, 2, 3], "p0", now=0.0)
    recent.note([1, 2], "p1", now=1.0)
    assert recent.overlap([1, 2, 3, 4], now=2.0) == {"p0": 3, "p1": 2}
    assert recent.overlap([9, 1], now=2.0) == {}
    assert recent.overlap([1, 2, 3], now=5.5) == {"p1": 2}  # p0's placement is older than 5 s
    recent.note([1], "p1", now=5.9)  # renewed: the older expiry of (1, p1) must not drop it
    assert recent.overlap([1, 2], now=6.5) == {"p1": 1}
    assert recent.overlap([1], now=11.0) == {} and len(recent) == 0
    off = RecentPlacements(ttl_s=0)
    off.note([1], "p0", now=0.0)
    assert off.overlap([1], now=0.0) == {}
    with pytest.raises(ValueError, match="ttl_s"):
        RecentPlacements(ttl_s=-1)
