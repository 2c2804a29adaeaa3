"""The pure placement policy: liveness, decode/prefill choice, conditional disaggregation, refusals."""

from __future__ import annotations

import pytest

from proto.messages import Role
from services.scheduler.policy import (
    PlacementRequest,
    Plan,
    PlanKind,
    PolicyConfig,
    Refuse,
    Wait,
    WorkerTable,
    schedule,
)
from tests.services.scheduler.factories import make_heartbeat, make_request, make_workers

CFG = PolicyConfig(direct_prefill_threshold=32)


def decide(
    table: WorkerTable, req: PlacementRequest | None = None, cfg: PolicyConfig = CFG, hits=None, now=0.0
):
    return schedule(table.live(now), req or make_request(), cfg, hits)


# --- conditional disaggregation --------------------------------------------------------------


def test_long_prompt_is_disaggregated_on_the_pair() -> None:
    d = decide(make_workers(), make_request(prompt_len=100, max_tokens=16))
    assert d == Plan(PlanKind.DISAGGREGATED, "d0", "p0", num_tokens=100, decode_pages=8, uncached=100)


@pytest.mark.parametrize(
    "prompt_len, kind", [(31, PlanKind.DIRECT), (32, PlanKind.DIRECT), (33, PlanKind.DISAGGREGATED)]
)
def test_short_prompt_goes_direct_up_to_the_threshold(prompt_len: int, kind: PlanKind) -> None:
    d = decide(make_workers(), make_request(prompt_len=prompt_len))
    assert isinstance(d, Plan) and d.kind is kind and d.decode == "d0"
    assert d.prefill == (None if kind is PlanKind.DIRECT else "p0")


def test_threshold_zero_disables_direct_prefill() -> None:
    d = decide(make_workers(), make_request(prompt_len=1), PolicyConfig(direct_prefill_threshold=0))
    assert isinstance(d, Plan) and d.kind is PlanKind.DISAGGREGATED


def test_cached_prefix_on_the_decode_worker_makes_a_long_prompt_direct() -> None:
    d = decide(make_workers(), make_request(prompt_len=100), hits={"d0": 80})
    assert isinstance(d, Plan) and d.kind is PlanKind.DIRECT and d.uncached == 20


def test_cached_prefix_on_the_prefill_worker_lowers_its_uncached_length() -> None:
    d = decide(make_workers(), make_request(prompt_len=100), hits={"p0": 64})
    assert isinstance(d, Plan) and d.kind is PlanKind.DISAGGREGATED and d.uncached == 36


def test_short_prompt_needs_no_prefill_worker() -> None:
    table = make_workers(make_heartbeat("d0"))
    assert isinstance(decide(table, make_request(prompt_len=10)), Plan)
    refused = decide(table, make_request(prompt_len=100))
    assert refused == Refuse(503, "no live prefill worker for model 'tiny'")


# --- decode choice ---------------------------------------------------------------------------


def test_least_loaded_decode_worker_wins() -> None:
    table = make_workers(
        make_heartbeat("d0", running=3), make_heartbeat("d1", running=1), make_heartbeat("p0", Role.PREFILL)
    )
    assert decide(table).decode == "d1"


def test_placements_since_the_last_heartbeat_count_as_load_until_the_next() -> None:
    table = make_workers(
        make_heartbeat("d0", running=1), make_heartbeat("d1", running=2), make_heartbeat("p0", Role.PREFILL)
    )
    table.note_placement("d0", pages=8)
    table.note_placement("d0", pages=8)
    assert decide(table).decode == "d1"  # d0: 1 running + 2 placed > d1: 2 running
    table.observe(make_heartbeat("d0", running=1), now=0.5)
    assert decide(table, now=0.5).decode == "d0"


def test_equal_load_prefers_most_free_pages_then_prefix_then_id() -> None:
    table = make_workers(
        make_heartbeat("d0", free_pages=20),
        make_heartbeat("d1", free_pages=40),
        make_heartbeat("p0", Role.PREFILL),
    )
    assert decide(table).decode == "d1"
    table = make_workers(make_heartbeat("d0"), make_heartbeat("d1"), make_heartbeat("p0", Role.PREFILL))
    assert decide(table).decode == "d0"
    assert decide(table, hits={"d1": 16}).decode == "d1"


def test_worker_without_room_for_prompt_plus_max_tokens_is_skipped() -> None:
    # 100 + 60 tokens = 10 pages of 16; d0 has 9 free, d1 has 10
    table = make_workers(
        make_heartbeat("d0", free_pages=9),
        make_heartbeat("d1", free_pages=10, running=5),
        make_heartbeat("p0", Role.PREFILL),
    )
    d = decide(table, make_request(prompt_len=100, max_tokens=60))
    assert isinstance(d, Plan) and d.decode == "d1" and d.decode_pages == 10


def test_no_free_pages_anywhere_means_wait() -> None:
    table = make_workers(make_heartbeat("d0", free_pages=2), make_heartbeat("p0", Role.PREFILL))
    assert isinstance(decide(table), Wait)


def test_inflight_pages_use_up_the_estimate() -> None:
    table = make_workers(make_heartbeat("d0", free_pages=16), make_heartbeat("p0", Role.PREFILL))
    assert isinstance(decide(table), Plan)  # needs 8 pages
    table.note_placement("d0", pages=8)
    assert isinstance(decide(table), Plan)
    table.note_placement("d0", pages=8)
    assert isinstance(decide(table), Wait)


def test_page_need_is_capped_at_the_worker_context() -> None:
    # 100 + 10_000 tokens would be 632 pages, but the context stops at 1024 tokens = 64 pages
    d = decide(make_workers(), make_request(prompt_len=100, max_tokens=10_000))
    assert isinstance(d, Plan) and d.decode_pages == 64


def test_suspended_worker_is_skipped_until_heard_again() -> None:
    table = make_workers(
        make_heartbeat("d0"), make_heartbeat("d1", running=4), make_heartbeat("p0", Role.PREFILL)
    )
    table.suspend("d0")
    assert decide(table).decode == "d1"
    table.suspend("d1")
    assert isinstance(decide(table), Wait)
    table.observe(make_heartbeat("d1", running=4), now=0.1)
    assert decide(table, now=0.1).decode == "d1"


def test_draining_and_other_model_workers_take_nothing() -> None:
    table = make_workers(
        make_heartbeat("d0", draining=True),
        make_heartbeat("d1", model="other"),
        make_heartbeat("d2", running=9),
        make_heartbeat("p0", Role.PREFILL),
    )
    assert decide(table).decode == "d2"
    only_draining = make_workers(make_heartbeat("d0", draining=True), make_heartbeat("p0", Role.PREFILL))
    assert decide(only_draining) == Refuse(503, "no live decode worker for model 'tiny'")


# --- prefill choice --------------------------------------------------------------------------


def test_prefill_worker_with_least_queued_work_wins() -> None:
    table = make_workers(
        make_heartbeat("d0"),
        make_heartbeat("p0", Role.PREFILL, running=1, waiting=3),
        make_heartbeat("p1", Role.PREFILL, running=2, waiting=1),
    )
    assert decide(table).prefill == "p1"
    table.note_placement("p1")
    table.note_placement("p1")
    assert decide(table).prefill == "p0"  # 4 vs 3 + 2 in flight


def test_of_two_prefill_workers_with_as_many_prompts_the_one_with_fewer_tokens_to_compute_wins() -> None:
    table = make_workers(
        make_heartbeat("d0"),
        make_heartbeat("p0", Role.PREFILL, running=1, waiting=2, waiting_tokens=6_000),
        make_heartbeat("p1", Role.PREFILL, running=2, waiting=1, waiting_tokens=2_500),
    )
    assert decide(table).prefill == "p1"
    table.note_placement("p0")
    table.note_placement("p1", tokens=4_000)  # both one prompt more; p1 now has more tokens ahead
    assert decide(table).prefill == "p0"
    table.observe(make_heartbeat("p1", Role.PREFILL, running=1, waiting=3, waiting_tokens=100), 0.0)
    assert decide(table).prefill == "p1"  # its heartbeat replaced the estimate


def test_prefix_overlap_breaks_prefill_ties() -> None:
    table = make_workers(
        make_heartbeat("d0"), make_heartbeat("p0", Role.PREFILL), make_heartbeat("p1", Role.PREFILL)
    )
    assert decide(table).prefill == "p0"
    assert decide(table, hits={"p1": 48}).prefill == "p1"
    assert (
        decide(
            make_workers(
                make_heartbeat("d0"),
                make_heartbeat("p0", Role.PREFILL, waiting=1),
                make_heartbeat("p1", Role.PREFILL, waiting=2),
            ),
            cfg=PolicyConfig(direct_prefill_threshold=32, prefix_weight=2.0),  # 2 x 48% < 1 more queued
            hits={"p1": 48},
        ).prefill
        == "p0"
    )


def test_suspended_prefill_workers_mean_wait() -> None:
    table = make_workers()
    table.suspend("p0")
    assert isinstance(decide(table), Wait)


# --- refusals --------------------------------------------------------------------------------


def test_no_workers_is_503() -> None:
    assert decide(WorkerTable()) == Refuse(503, "no live decode worker for model 'tiny'")


def test_prompt_longer_than_every_context_is_400() -> None:
    table = make_workers(make_heartbeat("d0", max_context=512), make_heartbeat("p0", Role.PREFILL))
    d = decide(table, make_request(prompt_len=512))
    assert isinstance(d, Refuse) and d.code == 400 and "largest max_context 512" in d.message
    table.observe(make_heartbeat("d1", max_context=2048), now=0.0)
    d = decide(table, make_request(prompt_len=512))
    assert isinstance(d, Plan) and d.decode == "d1"


def test_prompt_longer_than_every_prefill_context_is_400() -> None:
    table = make_workers(
        make_heartbeat("d0", max_context=4096, total_pages=512, free_pages=512),
        make_heartbeat("p0", Role.PREFILL, max_context=256),
    )
    d = decide(table, make_request(prompt_len=300))
    assert isinstance(d, Refuse) and d.code == 400 and "prefill" in d.message


def test_request_bigger_than_every_pool_is_400() -> None:
    table = make_workers(
        make_heartbeat("d0", total_pages=4, free_pages=4), make_heartbeat("p0", Role.PREFILL)
    )
    d = decide(table, make_request(prompt_len=60, max_tokens=10))  # 70 tokens = 5 pages > 4
    assert isinstance(d, Refuse) and d.code == 400 and "KV pages" in d.message


# --- liveness --------------------------------------------------------------------------------


def test_worker_dies_after_dead_after_intervals_of_silence() -> None:
    table = make_workers(
        make_heartbeat("d0", interval_ms=500), make_heartbeat("p0", Role.PREFILL, interval_ms=2000), now=10.0
    )
    assert table.next_expiry() == pytest.approx(11.5)
    assert {w.worker_id for w in table.live(11.5)} == {"d0", "p0"}
    assert {w.worker_id for w in table.live(11.6)} == {"p0"}
    assert isinstance(decide(table, now=11.6), Refuse)
    assert table.expire(11.6) == ["d0"] and "d0" not in table and "p0" in table
    table.observe(make_heartbeat("d0", interval_ms=500), now=12.0)  # a restarted worker comes back
    assert isinstance(decide(table, now=12.0), Plan)


def test_live_set_is_reused_only_while_nothing_changed() -> None:
    """live() and page_sizes() are kept between calls; every change shows at once, and a worker's
    expiry passing, too, as the uncached scan would see it at any reading of the clock."""
    table = make_workers(
        make_heartbeat("d0", interval_ms=500), make_heartbeat("p0", Role.PREFILL, page_size=32), now=10.0
    )
    ids = lambda now: [w.worker_id for w in table.live(now)]  # noqa: E731
    assert ids(10.0) == ["d0", "p0"] and table.live(10.2) is table.live(10.0)
    assert table.page_sizes(10.0) == {16, 32}
    assert ids(11.6) == ["p0"] and table.page_sizes(11.6) == {32}  # d0 silent past 1.5 s
    assert ids(11.0) == ["d0", "p0"]  # an earlier reading: computed again, not the later set
    table.observe(make_heartbeat("d0", interval_ms=500, running=3), now=11.0)
    (d0,) = [w for w in table.live(11.2) if w.worker_id == "d0"]
    assert d0.hb.running == 3  # the new heartbeat's state, not the cached one
    table.note_placement("d0", pages=2)
    assert table.live(11.3)[0].inflight == 1  # placements update the members in place
    assert table.gone("p0") and ids(11.3) == ["d0"] and table.page_sizes(11.3) == {16}
    table.observe(make_heartbeat("p1", Role.PREFILL, interval_ms=500), now=11.4)
    assert ids(11.4) == ["d0", "p1"]
    assert table.expire(13.0) == ["d0", "p1"] and ids(13.0) == [] and table.page_sizes(13.0) == frozenset()


def test_worker_gone_is_forgotten_at_once() -> None:
    table = make_workers()
    assert table.gone("d0") and not table.gone("d0")
    assert decide(table) == Refuse(503, "no live decode worker for model 'tiny'")
    assert WorkerTable().next_expiry() is None


# --- bad input -------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        make_request(prompt_len=0)
    with pytest.raises(ValueError, match="max_tokens"):
        make_request(max_tokens=0)
    with pytest.raises(ValueError, match="direct_prefill_threshold"):
        PolicyConfig(direct_prefill_threshold=-1)
    with pytest.raises(ValueError, match="dead_after_intervals"):
        WorkerTable(0)
    with pytest.raises(ValueError, match="page_size"):
        WorkerTable().observe(make_heartbeat("d0", page_size=0), 0.0)
