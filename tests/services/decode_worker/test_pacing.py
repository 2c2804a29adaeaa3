"""The decode worker's step pacing, event by event, with no event loop: every state's transitions, the
wake-up that comes during a step, the kicked step with nothing after it, inline kicks, slow-down."""

from __future__ import annotations

import pytest

from services.decode_worker.pacing import Action, Pacing, State

A = Action


def run(p: Pacing, *script: tuple[str, object]) -> list[Action | None]:
    """Feed events ("wake", "kick" tokens, "finished" (more, queued), "failed", "slowdown" ms, "next") and
    collect what each returns."""
    got: list[Action | None] = []
    for event, arg in script:
        match event:
            case "wake":
                got.append(p.wake())  # type: ignore[func-returns-value]
            case "kick":
                got.append(p.kick(arg))  # type: ignore[arg-type]
            case "finished":
                got.append(p.finished(*arg))  # type: ignore[misc]
            case "failed":
                got.append(p.failed())  # type: ignore[func-returns-value]
            case "slowdown":
                got.append(p.set_slowdown(arg))  # type: ignore[arg-type,func-returns-value]
            case "next":
                got.append(p.next())
    return [g for g in got if g is not None]


NEXT, WAKE = ("next", None), ("wake", None)


def test_an_idle_loop_waits_until_woken_then_steps_until_the_work_is_done() -> None:
    p = Pacing()
    assert p.next() is A.WAIT and p.state is State.IDLE and p.idle
    assert p.next() is A.WAIT  # woken for nothing (a stale signal): waits again
    p.wake()
    assert not p.idle and p.state is State.IDLE  # woken, not yet resumed
    assert p.next() is A.STEP and p.state is State.STEPPING and not p.pending
    assert p.finished(more=True, queued=False) is A.PUBLISH and p.state is State.PUBLISHING
    assert p.next() is A.STEP  # work left: the next step at once
    assert p.finished(more=False, queued=False) is A.PUBLISH
    assert p.next() is A.WAIT and p.idle


def test_a_wake_up_during_a_step_that_says_no_more_work_is_stepped() -> None:
    """The lost wake-up: a request joins while the last step runs; that step's "nothing more" must not
    drop the join's wake-up."""
    p = Pacing()
    assert run(p, WAKE, NEXT, WAKE, ("finished", (False, False)), NEXT) == [A.STEP, A.PUBLISH, A.STEP]
    assert run(p, ("finished", (False, False)), NEXT) == [A.PUBLISH, A.WAIT]


def test_a_wake_up_during_the_publish_is_stepped() -> None:
    p = Pacing()
    assert run(p, WAKE, NEXT, ("finished", (False, False)), WAKE, NEXT) == [A.STEP, A.PUBLISH, A.STEP]


def test_a_kicked_step_is_the_loops_own_and_no_empty_step_follows() -> None:
    p = Pacing(inline_max_tokens=256)
    p.next()
    p.wake()  # start_direct wakes, then kicks
    assert p.kick(5) is A.INLINE and p.state is State.KICKED and not p.pending
    assert p.next() is A.TAKE and p.state is State.STEPPING
    assert p.finished(more=False, queued=False) is A.PUBLISH
    assert p.next() is A.WAIT  # the kick's wake-up was the kicked step's


def test_a_wake_up_between_the_kick_and_the_loop_taking_it_brings_another_step() -> None:
    p = Pacing(inline_max_tokens=256)
    p.next()
    assert run(p, WAKE, ("kick", 5), WAKE, NEXT, ("finished", (False, False)), NEXT) == [
        A.INLINE, A.TAKE, A.PUBLISH, A.STEP,
    ]  # fmt: skip


def test_a_wake_up_before_the_kick_is_the_kicked_steps() -> None:
    """A request joined and woke the loop, which has not resumed yet: the kicked step takes it too."""
    p = Pacing(inline_max_tokens=256)
    p.next()
    assert run(p, WAKE, WAKE, ("kick", 5), NEXT, ("finished", (False, False)), NEXT) == [
        A.INLINE, A.TAKE, A.PUBLISH, A.WAIT,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("inline_max", "tokens", "want"),
    [(256, 256, A.INLINE), (256, 257, A.STEP), (0, 1, A.STEP), (0, 0, A.INLINE)],
)
def test_a_kicked_step_is_inline_up_to_the_bound(inline_max: int, tokens: int, want: Action) -> None:
    """INLINE: the shell runs it on the event loop when the engine thread is idle, else queues it there."""
    p = Pacing(inline_max_tokens=inline_max)
    p.next()
    p.wake()
    assert p.kick(tokens) is want and p.state is State.KICKED


def test_no_kick_unless_the_loop_is_idle() -> None:
    p = Pacing(inline_max_tokens=256)
    p.next()
    p.wake()
    assert p.kick(1) is A.INLINE
    p.wake()
    assert p.kick(1) is A.QUEUE and p.state is State.KICKED  # one kicked step at a time
    p.next()
    for state_of in (lambda: None, lambda: p.finished(True, False)):
        state_of()
        p.wake()
        assert p.kick(1) is A.QUEUE  # a step running, or its tokens being published
    assert p.next() is A.STEP  # the queued prompts go with the loop's next step


def test_overlap_starts_the_next_step_before_the_publish_while_work_is_left() -> None:
    p = Pacing(overlap=True)
    assert run(p, WAKE, NEXT) == [A.STEP]
    assert p.finished(more=True, queued=False) is A.STEP and p.state is State.OVERLAPPED
    assert p.next() is A.AWAIT and p.state is State.STEPPING  # after the publish: the running step
    assert p.finished(more=False, queued=True) is A.STEP  # direct prompts wait: overlapped too
    assert p.next() is A.AWAIT
    assert p.finished(more=False, queued=False) is A.PUBLISH  # nothing left: publish, then wait
    assert p.next() is A.WAIT


def test_overlap_after_a_kicked_step_and_a_wake_up_taken_by_the_overlapped_step() -> None:
    p = Pacing(overlap=True, inline_max_tokens=256)
    p.next()
    assert run(p, WAKE, ("kick", 3), NEXT, WAKE) == [A.INLINE, A.TAKE]
    assert p.finished(more=True, queued=False) is A.STEP and not p.pending  # the new step took the wake-up
    assert run(p, NEXT, ("finished", (False, False)), NEXT) == [A.AWAIT, A.PUBLISH, A.WAIT]


def test_without_overlap_every_step_follows_the_publish() -> None:
    p = Pacing(overlap=False)
    p.wake()
    p.next()
    assert p.finished(more=True, queued=True) is A.PUBLISH and p.state is State.PUBLISHING


def test_a_slowed_loop_sleeps_before_each_step_and_never_overlaps_or_kicks() -> None:
    p = Pacing(overlap=True, sleep_ms=20.0, inline_max_tokens=256)
    assert p.next() is A.WAIT
    p.wake()
    assert p.kick(1) is A.QUEUE  # no kick under a slow-down: the loop sleeps first
    assert p.next() is A.SLEEP and p.state is State.SLOWED and p.pending
    assert p.next() is A.STEP and not p.pending  # slept
    assert p.finished(more=True, queued=False) is A.PUBLISH  # no overlap while slowed
    assert p.next() is A.SLEEP


def test_a_new_slowdown_setting_ends_the_sleep_and_the_step_starts() -> None:
    for new in (0.0, 5.0, 500.0):
        p = Pacing(sleep_ms=100.0)
        p.wake()
        assert p.next() is A.SLEEP
        p.set_slowdown(new)
        p.wake()  # the shell wakes the loop for a new setting
        assert p.next() is A.STEP and p.sleep_ms == new  # not a second sleep under the new setting


def test_turning_the_slowdown_on_and_off() -> None:
    p = Pacing(overlap=True)
    p.set_slowdown(-3.0)
    assert p.sleep_ms == 0.0  # clamped
    assert run(p, WAKE, NEXT, ("slowdown", 10.0), ("finished", (True, False)), NEXT) == [
        A.STEP, A.PUBLISH, A.SLEEP,
    ]  # fmt: skip
    assert run(p, ("slowdown", 0.0), NEXT, ("finished", (True, False))) == [A.STEP, A.STEP]


def test_a_failed_step_waits_unless_woken() -> None:
    p = Pacing()
    assert run(p, WAKE, NEXT, ("failed", None), NEXT) == [A.STEP, A.WAIT]
    assert run(p, WAKE, NEXT, WAKE, ("failed", None), NEXT) == [A.STEP, A.STEP]
