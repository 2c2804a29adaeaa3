"""When a supervised service that exited is started again, as pure functions of (record, policy, now)."""

# The rule is systemd's `Restart=always` with `StartLimitBurst` / `StartLimitIntervalSec`, plus
# Kubernetes' CrashLoopBackOff delays:
#
# - every exit is restarted after a delay that doubles with each exit still inside the window
#   (`backoff_s`, `2 * backoff_s`, ... capped at `max_backoff_s`);
# - an exit that would make more than `max_restarts` restarts inside `window_s` gives the service up: it
#   stays down (loudly, the caller prints why) and the rest of the mesh keeps serving;
# - exits older than the window are forgotten, so a service that crashes once a day is always restarted
#   at the first delay.
#
# The supervisor (libs.launch.supervisor) owns the processes and the clock; this module owns no I/O.

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class State(enum.StrEnum):
    UP = "up"  # its process is running
    RESTARTING = "restarting"  # it exited; started again at `restart_at`
    GIVEN_UP = "given_up"  # too many exits inside the window: left down
    STOPPED = "stopped"  # stopped on purpose (the mesh is shutting down)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5  # delay before the first restart
    backoff_factor: float = 2.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5  # restarts allowed inside window_s; one more exit gives the service up
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s or self.backoff_factor < 1:
            raise ValueError(f"need 0 <= backoff_s <= max_backoff_s and backoff_factor >= 1: {self}")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError(f"need max_restarts >= 0 and window_s > 0: {self}")

    def delay(self, exits_in_window: int) -> float:
        """Backoff before the restart that follows the n-th exit inside the window (n >= 1)."""
        return min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** max(0, exits_in_window - 1))


@dataclass(frozen=True)
class ServiceRecord:
    """One service's supervision state."""

    state: State = State.UP
    restarts: int = 0  # restarts done since the mesh started (this process's incarnation - 1)
    exits: tuple[float, ...] = ()  # times of the exits still inside the window
    restart_at: float | None = None  # when RESTARTING
    last_exit_code: int | None = None
    since: float = 0.0  # when the current state began


def on_exit(rec: ServiceRecord, policy: RestartPolicy, now: float, code: int | None) -> ServiceRecord:
    """The service's process exited (crash or clean exit alike: a service is never meant to stop)."""
    if rec.state is not State.UP:
        return rec
    exits = (*(t for t in rec.exits if now - t < policy.window_s), now)
    if len(exits) > policy.max_restarts:
        return replace(
            rec, state=State.GIVEN_UP, exits=exits, restart_at=None, last_exit_code=code, since=now
        )
    at = now + policy.delay(len(exits))
    return replace(rec, state=State.RESTARTING, exits=exits, restart_at=at, last_exit_code=code, since=now)


def due(rec: ServiceRecord, now: float) -> bool:
    """Whether a restarting service's backoff has passed."""
    return rec.state is State.RESTARTING and rec.restart_at is not None and now >= rec.restart_at


def on_restarted(rec: ServiceRecord, now: float) -> ServiceRecord:
    return replace(rec, state=State.UP, restarts=rec.restarts + 1, restart_at=None, since=now)


def on_stopped(rec: ServiceRecord, now: float) -> ServiceRecord:
    return replace(rec, state=State.STOPPED, restart_at=None, since=now)


def describe_exit(name: str, rec: ServiceRecord, policy: RestartPolicy, now: float) -> str:
    """One line for the operator after `on_exit`: what happened and what the supervisor does next."""
    code = rec.last_exit_code
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    if rec.state is State.GIVEN_UP:
        return (
            f"{name} {how}; GIVING UP after {len(rec.exits)} exits within {policy.window_s:g} s "
            f"(limit {policy.max_restarts} restarts): it stays down, the rest of the mesh keeps serving"
        )
    wait = (rec.restart_at or now) - now
    return (
        f"{name} {how}; restarting in {wait:.1f} s "
        f"(exit {len(rec.exits)} of at most {policy.max_restarts + 1} within {policy.window_s:g} s)"
    )
