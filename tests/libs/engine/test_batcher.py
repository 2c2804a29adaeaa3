"""Pure planning tests: requests are small SeqView factories, the 'engine' is a dict update."""

from dataclasses import replace

import pytest

from libs.engine.batcher import Batcher, Plan, SeqView, pages_for

PS = 4


def make_requests(*prompt_lens: int, prefix: str = "r", cached: int = 0) -> list[SeqView]:
    return [SeqView(f"{prefix}{i}", cached, n) for i, n in enumerate(prompt_lens)]


def decoding(rid: str, num_tokens: int, num_cached_pages: int = 0) -> SeqView:
    """A request that has produced output and feeds its newest token next."""
    return SeqView(rid, num_tokens - 1, num_tokens, pages_for(num_tokens - 1, PS), num_cached_pages, True)


def apply(plan: Plan, running: list[SeqView], waiting: list[SeqView]) -> tuple[list, list, int]:
    """What the engine does with a plan (pages used; sampling appends one token at a prompt's end)."""
    by_rid = {s.rid: s for s in running + waiting}
    running = [s for s in running if s.rid not in plan.preempt]
    waiting = [s for s in waiting if s.rid not in plan.admit]
    running += [by_rid[r] for r in plan.admit]
    chunks = dict(plan.prefill) | {r: 1 for r in plan.decode}
    used = sum(plan.new_pages.values())
    out = []
    for s in running:
        if s.rid in chunks:
            done = s.num_computed + chunks[s.rid]
            held = s.num_computed // PS if s.rid in plan.admit else s.num_pages  # admitted: the cached pages
            pages = held + plan.new_pages[s.rid]
            grew = done == s.num_tokens
            s = SeqView(s.rid, done, s.num_tokens + grew, pages, s.num_cached_pages, grew or s.decoding)
        out.append(s)
    preempted = [replace(by_rid[r], num_computed=0, num_pages=0, decoding=False) for r in plan.preempt]
    return out, waiting + preempted, used


def test_decode_all_running_and_admit_in_fifo_order():
    sched = Batcher(PS, max_num_seqs=8, max_prefill_tokens=100)
    running = [decoding("a", 9), decoding("b", 6)]
    plan = sched.schedule(running, make_requests(5, 7), free_pages=100)
    assert plan.decode == ["a", "b"]
    assert plan.prefill == [("r0", 5), ("r1", 7)] and plan.admit == ["r0", "r1"]
    assert plan.new_pages == {"a": 1, "b": 0, "r0": 2, "r1": 2}  # a's 9th token starts page 3


def test_chunked_prefill_under_a_token_budget():
    sched = Batcher(PS, max_prefill_tokens=6)
    running, waiting = [], make_requests(10, 3)
    plan = sched.schedule(running, waiting, 100)
    assert plan.prefill == [("r0", 6)] and plan.admit == ["r0"]
    running, waiting, _ = apply(plan, running, waiting)
    plan = sched.schedule(running, waiting, 100)
    assert plan.prefill == [("r0", 4), ("r1", 2)]  # r0 finishes its prompt, r1 starts in the leftover budget
    running, waiting, _ = apply(plan, running, waiting)
    plan = sched.schedule(running, waiting, 100)
    assert plan.decode == ["r0"] and plan.prefill == [("r1", 1)]


def test_max_num_seqs_caps_admission():
    sched = Batcher(PS, max_num_seqs=2, max_prefill_tokens=100)
    plan = sched.schedule([decoding("a", 5)], make_requests(3, 3), 100)
    assert plan.admit == ["r0"]


def test_admission_is_fifo_and_charges_the_whole_prompt():
    sched = Batcher(PS, max_prefill_tokens=4)
    # r0 needs 5 pages for its whole prompt even though only one chunk runs now; r1 must not overtake it.
    plan = sched.schedule([], make_requests(20, 2), free_pages=4)
    assert plan.empty
    plan = sched.schedule([], make_requests(20, 2), free_pages=5)
    assert plan.admit == ["r0"] and plan.new_pages == {"r0": 1}


def test_prefix_hit_starts_after_the_cached_pages():
    sched = Batcher(PS, max_prefill_tokens=100)
    plan = sched.schedule([], make_requests(11, cached=8), 100)
    assert plan.prefill == [("r0", 3)] and plan.new_pages == {"r0": 1}


def test_half_done_prompt_keeps_its_pages_from_newcomers():
    sched = Batcher(PS, max_prefill_tokens=4)
    running = [SeqView("a", 4, 16, 1)]  # 3 more pages to come
    plan = sched.schedule(running, make_requests(1), free_pages=3)
    assert plan.prefill == [("a", 4)] and plan.admit == []
    plan = sched.schedule(running, make_requests(1), free_pages=4)
    assert plan.admit == [] and plan.prefill == [("a", 4)]  # the prefill budget is spent anyway
    sched = Batcher(PS, max_prefill_tokens=13)
    plan = sched.schedule(running, make_requests(1), free_pages=4)
    assert plan.prefill == [("a", 12), ("r0", 1)]


def test_decode_preempts_the_newest_when_pages_run_out():
    sched = Batcher(PS)
    running = [decoding("old", 9), decoding("mid", 5, num_cached_pages=0), decoding("new", 13, 2)]
    # every one needs a fresh page (positions 8, 4, 12); only one page is free
    plan = sched.schedule(running, [], free_pages=1)
    # preempting "new" frees 3 - 2 = 1 own page (2 are shared from the cache), enough for "mid" too
    assert plan.preempt == ["new"]
    assert plan.decode == ["old", "mid"]
    assert sum(plan.new_pages.values()) == 2


def test_oldest_request_preempts_itself_last():
    sched = Batcher(PS)
    plan = sched.schedule([decoding("only", 9)], [], free_pages=0)
    assert plan.preempt == ["only"] and plan.empty


def test_stuck_prompts_let_the_oldest_through():
    sched = Batcher(PS, max_prefill_tokens=100)
    running = [SeqView("a", 4, 12, 1), SeqView("b", 4, 12, 1)]
    plan = sched.schedule(running, [], free_pages=0)
    assert plan.preempt == ["b"] and plan.prefill == [("a", 4)]


def test_simulated_run_never_exceeds_the_pool_and_finishes_everything():
    """Join/leave over many steps: page use stays within the pool and every prompt completes."""
    sched = Batcher(PS, max_num_seqs=3, max_prefill_tokens=7)
    pool = 12
    waiting = make_requests(9, 3, 14, 5, 6)
    running: list[SeqView] = []
    prompt_len = {s.rid: s.num_tokens for s in waiting}
    finished = []
    for _ in range(200):
        if not running and not waiting:
            break
        held = sum(s.num_pages for s in running)
        plan = sched.schedule(running, waiting, pool - held)
        assert not plan.empty
        running, waiting, used = apply(plan, running, waiting)
        assert sum(s.num_pages for s in running) <= pool
        for s in list(running):  # each request stops after 4 generated tokens
            if s.decoding and s.num_tokens >= prompt_len[s.rid] + 4:
                running.remove(s)
                finished.append(s.rid)
    assert sorted(finished) == [f"r{i}" for i in range(5)]


def test_bad_config():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Batcher(PS, max_prefill_tokens=0)
