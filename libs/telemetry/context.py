"""Request context that rides in NATS headers from hop to hop: W3C trace context and a deadline."""

# While the bus runs a handler, the incoming message's `traceparent` and `Moemesh-Deadline` (epoch ms)
# are set in contextvars; every publish/request made from that handler carries them on. So a deadline
# set once at the gateway bounds every hop below it without being passed around by hand.

from __future__ import annotations

import contextlib
import contextvars
import re
import secrets
import time
from collections.abc import Iterator, Mapping

TRACEPARENT = "traceparent"
DEADLINE = "Moemesh-Deadline"

_TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")

_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("moemesh_traceparent", default=None)
_deadline_ms: contextvars.ContextVar[int | None] = contextvars.ContextVar("moemesh_deadline_ms", default=None)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def current_traceparent() -> str | None:
    return _traceparent.get()


def current_deadline() -> int | None:
    """The deadline in force (epoch ms), or None when there is none."""
    return _deadline_ms.get()


def time_left() -> float | None:
    """Seconds until the deadline in force (negative when past), or None when there is none."""
    d = _deadline_ms.get()
    return None if d is None else (d - now_ms()) / 1000.0


def new_traceparent() -> str:
    """A fresh, sampled W3C traceparent (version 00) for a request that starts a trace."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


@contextlib.contextmanager
def request_context(
    *, traceparent: str | None = None, deadline_ms: int | None = None, timeout: float | None = None
) -> Iterator[None]:
    """Set trace context and/or deadline for the block. `timeout` (seconds from now) tightens the
    deadline; a deadline never moves later than the one already in force."""
    if traceparent is not None and not _TRACEPARENT_RE.match(traceparent):
        raise ValueError(f"invalid W3C traceparent: {traceparent!r}")
    deadline = _tightest(_deadline_ms.get(), deadline_ms)
    if timeout is not None:
        deadline = _tightest(deadline, now_ms() + int(timeout * 1000))
    t1 = _traceparent.set(traceparent) if traceparent is not None else None
    t2 = _deadline_ms.set(deadline)
    try:
        yield
    finally:
        _deadline_ms.reset(t2)
        if t1 is not None:
            _traceparent.reset(t1)


def _tightest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def context_from_headers(headers: Mapping[str, str] | None) -> tuple[str | None, int | None]:
    """(traceparent, deadline_ms) read from incoming headers; malformed values are ignored."""
    if not headers:
        return None, None
    tp = headers.get(TRACEPARENT)
    if tp is not None and not _TRACEPARENT_RE.match(tp):
        tp = None
    raw = headers.get(DEADLINE)
    deadline = int(raw) if raw is not None and raw.isdigit() else None
    return tp, deadline


@contextlib.contextmanager
def incoming_context(headers: Mapping[str, str] | None) -> Iterator[None]:
    """Adopt an incoming message's context (replacing, not merging with, the current one)."""
    tp, deadline = context_from_headers(headers)
    t1 = _traceparent.set(tp)
    t2 = _deadline_ms.set(deadline)
    try:
        yield
    finally:
        _deadline_ms.reset(t2)
        _traceparent.reset(t1)


def outgoing_headers(
    extra: Mapping[str, str] | None = None, deadline_ms: int | None = None
) -> dict[str, str] | None:
    """Headers for an outgoing message: the context in force, then `extra` (which wins).
    None when there is nothing to send, so plain messages carry no header block."""
    headers: dict[str, str] = {}
    tp = _traceparent.get()
    if tp is not None:
        headers[TRACEPARENT] = tp
    d = _tightest(_deadline_ms.get(), deadline_ms)
    if d is not None:
        headers[DEADLINE] = str(d)
    if extra:
        headers.update(extra)
    return headers or None
