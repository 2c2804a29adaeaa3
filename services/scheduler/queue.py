"""The scheduler's admission queue: pure bookkeeping, no I/O; times are monotonic seconds passed in."""

# Entries are either pending (waiting for a placement, FIFO by admission order) or placing (a placement
# is in flight: a ReserveKv round trip). The bound `max_queue` counts both, since both hold a promise to
# the gateway. A pending entry past its deadline is expired (the caller fails it with a 504-like error).
# A placement that fails puts the entry back at its original place in line, up to `max_retries` times;
# after that the caller fails the request. Cancel removes a pending entry at once and marks a placing
# one so its in-flight placement is not carried on.

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

from proto.messages import Submit


class QueueFull(Exception):
    """The queue holds `max_queue` requests already (the gateway answers 429)."""


class DuplicateRequest(ValueError):
    """A request id that is already queued or being placed."""


@dataclass
class Entry:
    """One admitted request. `attempts` counts failed placements; `traceparent` is the submit's trace
    context, carried onto the messages sent for it later."""

    submit: Submit
    deadline: float
    admitted_at: float
    seq: int
    attempts: int = 0
    cancelled: bool = False
    last_error: str = ""
    traceparent: str | None = None

    @property
    def request_id(self) -> str:
        return self.submit.request_id


class Retry(enum.Enum):
    RETRY = "retry"  # back in line for another placement
    EXHAUSTED = "exhausted"  # max_retries used up: fail the request
    GONE = "gone"  # cancelled (or unknown) meanwhile: nothing to do


@dataclass
class AdmissionQueue:
    max_queue: int
    max_retries: int
    _pending: dict[str, Entry] = field(default_factory=dict)
    _placing: dict[str, Entry] = field(default_factory=dict)
    _order: list[tuple[int, str]] = field(default_factory=list)  # heap (seq, request_id), lazily pruned
    _seq: int = 0

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")

    def __len__(self) -> int:
        return len(self._pending) + len(self._placing)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pending or request_id in self._placing

    @property
    def depth(self) -> int:
        """Requests waiting for a placement (not counting those being placed)."""
        return len(self._pending)

    @property
    def placing(self) -> int:
        return len(self._placing)

    def admit(
        self,
        submit: Submit,
        now: float,
        deadline: float,
        traceparent: str | None = None,
    ) -> Entry:
        """Queue a request; raises QueueFull or DuplicateRequest."""
        if submit.request_id in self:
            raise DuplicateRequest(f"request {submit.request_id!r} is already queued")
        if len(self) >= self.max_queue:
            raise QueueFull(f"queue full ({self.max_queue} requests)")
        entry = Entry(submit, deadline, now, self._seq, traceparent=traceparent)
        self._seq += 1
        self._pending[entry.request_id] = entry
        heapq.heappush(self._order, (entry.seq, entry.request_id))
        return entry

    def head(self) -> Entry | None:
        """The oldest pending entry (FIFO by admission, retried entries keep their place)."""
        while self._order:
            seq, rid = self._order[0]
            e = self._pending.get(rid)
            if e is not None and e.seq == seq:
                return e
            heapq.heappop(self._order)
        return None

    def start(self, request_id: str) -> Entry:
        """Move a pending entry to placing (a placement is in flight)."""
        e = self._pending.pop(request_id)
        self._placing[request_id] = e
        return e

    def finish(self, request_id: str) -> Entry | None:
        """The placement went through (or the request was failed): forget it."""
        return self._placing.pop(request_id, None)

    def fail(self, request_id: str, error: str) -> Retry:
        """A placement failed: put the request back in line, or say its retries are used up."""
        e = self._placing.pop(request_id, None)
        if e is None or e.cancelled:
            return Retry.GONE
        e.attempts += 1
        e.last_error = error
        if e.attempts > self.max_retries:
            return Retry.EXHAUSTED
        self._pending[request_id] = e
        heapq.heappush(self._order, (e.seq, request_id))
        return Retry.RETRY

    def remove(self, request_id: str) -> Entry | None:
        """Drop a pending entry (refused after admission)."""
        return self._pending.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Drop a pending request, or mark a placing one cancelled; True if it was held here."""
        if self._pending.pop(request_id, None) is not None:
            return True
        e = self._placing.get(request_id)
        if e is not None:
            e.cancelled = True
            return True
        return False

    def is_cancelled(self, request_id: str) -> bool:
        e = self._placing.get(request_id)
        return e is None or e.cancelled

    def expire(self, now: float) -> list[Entry]:
        """Remove and return pending entries whose deadline has passed."""
        late = [e for e in self._pending.values() if now >= e.deadline]
        for e in late:
            del self._pending[e.request_id]
        return late

    def next_deadline(self) -> float | None:
        return min((e.deadline for e in self._pending.values()), default=None)
