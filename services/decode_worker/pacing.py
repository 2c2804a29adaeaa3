"""When the decode worker's step loop waits, sleeps, steps or publishes: a pure state machine. The shell
(service.py) reports events (`wake`, `kick`, `finished`, `failed`, `set_slowdown`) and runs what `next`
returns; no asyncio, engine or bus here, and no allocation per call."""

from __future__ import annotations

import enum


class State(enum.Enum):
    IDLE = "idle"  # no step in flight; the loop waits for a wake-up
    KICKED = "kicked"  # a direct prompt's step, started while the loop was idle, runs for the loop
    SLOWED = "slowed"  # slow-down: the loop waits before its next step
    STEPPING = "stepping"  # the loop awaits its step
    PUBLISHING = "publishing"  # the loop publishes a step's tokens, no step in flight
    OVERLAPPED = "overlapped"  # the loop publishes a step's tokens while the next step runs


class Action(enum.Enum):
    WAIT = "wait"  # wait for a wake-up, then ask `next` again
    SLEEP = "sleep"  # wait sleep_ms, or until the slow-down setting changes, then ask `next` again
    STEP = "step"  # start a step on the engine thread (its direct prompts with it)
    INLINE = "inline"  # start it on the calling thread if the engine thread is idle, else as STEP
    TAKE = "take"  # await the kicked step as the loop's own
    AWAIT = "await"  # await the step started before the last publish
    PUBLISH = "publish"  # publish the finished step's tokens, then ask `next`
    QUEUE = "queue"  # (kick) leave the prompt queued for the loop's next step


class Pacing:
    """A wake-up stays pending until a step starts: every wake-up before a step's start is that step's (its
    work was queued on the engine thread, or with the step's prompts, first), and one that comes while a
    step runs is the next pass's, whatever that step says of the work left."""

    __slots__ = ("state", "pending", "sleep_ms", "overlap", "inline_max_tokens", "_more")

    def __init__(self, overlap: bool = False, sleep_ms: float = 0.0, inline_max_tokens: int = 0) -> None:
        self.state = State.IDLE
        self.pending = False  # a wake-up no started step has taken yet
        self.sleep_ms = sleep_ms
        self.overlap = overlap  # start the next step before publishing the last one's tokens
        self.inline_max_tokens = inline_max_tokens  # a kicked step of at most this many prompt tokens: INLINE
        self._more = False  # the last finished step said work is left

    @property
    def idle(self) -> bool:
        """The loop waits and nothing is pending for it."""
        return self.state is State.IDLE and not self.pending

    def wake(self) -> None:
        """Work arrived (a request joined, a prompt queued, a setting changed): the next step takes it."""
        self.pending = True

    def set_slowdown(self, sleep_ms: float) -> None:
        """Each later step first waits this long (0: off). The shell ends a running SLEEP at once: the
        step it waited for starts then, under whatever the new setting is."""
        self.sleep_ms = max(0.0, sleep_ms)

    def kick(self, queued_tokens: int) -> Action:
        """A direct prompt was queued (after `wake`): INLINE or STEP when the loop is idle and not slowed
        (the caller starts the step at once, for the loop to TAKE), else QUEUE."""
        if self.state is not State.IDLE or self.sleep_ms:
            return Action.QUEUE
        self.state = State.KICKED
        self.pending = False  # the kicked step takes every wake-up so far
        return Action.INLINE if queued_tokens <= self.inline_max_tokens else Action.STEP

    def next(self) -> Action:
        """The loop's next action when it holds no finished step."""
        state = self.state
        if state is State.KICKED:
            self.state = State.STEPPING
            return Action.TAKE
        if state is State.OVERLAPPED:
            self.state = State.STEPPING
            return Action.AWAIT
        if state is State.SLOWED:  # slept, or the setting changed: step now
            return self._step()
        if state is State.PUBLISHING and self._more:
            self.pending = True
        if not self.pending:
            self.state = State.IDLE
            return Action.WAIT
        if self.sleep_ms:
            self.state = State.SLOWED
            return Action.SLEEP
        return self._step()

    def finished(self, more: bool, queued: bool) -> Action:
        """The step returned (`more`: the engine has work left; `queued`: direct prompts wait): STEP (start
        the next now, then publish) with overlap and no slow-down, else PUBLISH."""
        self._more = more
        if self.overlap and (more or queued) and not self.sleep_ms:
            self.state = State.OVERLAPPED
            self.pending = False
            return Action.STEP
        self.state = State.PUBLISHING
        return Action.PUBLISH

    def failed(self) -> None:
        """The step raised: its batch is failed; only a pending wake-up brings another step."""
        self._more = False
        self.state = State.PUBLISHING

    def _step(self) -> Action:
        self.state = State.STEPPING
        self.pending = False
        return Action.STEP
