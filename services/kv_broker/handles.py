"""KV-handle lifecycle as pure functions of (record, now_ms): no I/O, no clock of its own."""

#     reserved --HandleWritten--> written --HandleConsumed--> consumed --(retention)--> forgotten
#         |                          |
#         +------ lease passes ------+--> expired (owner told to free the pages) --(retention)--> forgotten
#     ReleaseHandle: forgotten at once, from any state.
#
# A decode worker that registers again from a new process (another Mooncake session: it restarted) is a
# new incarnation: every live handle into its old pool is expired at once, since those pages belonged to a
# process that is gone and nothing may be written into or claimed from them.
#
# A handle past its lease is expired even before the sweeper gets to it: written/consumed on it are
# refused, so nobody uses pages the owner may already be reusing. Consumed straight from reserved is
# allowed: KvReady reaching the decode worker proves the write happened, and the hot path need not wait
# for the prefill worker's HandleWritten to reach the broker first. Consumed and expired records are kept
# for `retention_ms` so a late message gets "expired"/"consumed" rather than "unknown handle".

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.kvtransfer.ranks import sessions, target_pool
from proto.messages import HandleRecord, HandleState, KvHandle, WorkerRecord

LIVE = (HandleState.RESERVED, HandleState.WRITTEN)
_KEY_RE = re.compile(r"^[-_=a-zA-Z0-9]+$")  # JetStream KV key characters, no '.' (keeps keys one token)


class HandleError(ValueError):
    """A refused request; the message says why (sent back in BrokerReply.message)."""


def check_id(kind: str, value: str) -> str:
    if not _KEY_RE.match(value or ""):
        raise HandleError(f"invalid {kind} {value!r}: use letters, digits, '-', '_' or '='")
    return value


def overdue(rec: HandleRecord, now_ms: int) -> bool:
    return rec.state in LIVE and now_ms >= rec.handle.lease_expires_ms


def create(
    existing: HandleRecord | None,
    handle: KvHandle,
    worker: WorkerRecord | None,
    now_ms: int,
    max_lease_ms: int,
) -> HandleRecord:
    """A new reserved record; the same CreateHandle again returns the existing record (client retry)."""
    check_id("handle_id", handle.handle_id)
    if existing is not None:
        if existing.handle == handle:
            return existing
        raise HandleError(f"handle {handle.handle_id} already exists (request {existing.handle.request_id})")
    if worker is None:
        raise HandleError(f"decode worker {handle.decode_worker!r} is not registered at the kv-broker")
    try:
        session, geometry = target_pool(worker, handle.decode_rank)
    except ValueError as e:
        raise HandleError(str(e)) from None
    if session != handle.session_id:
        raise HandleError(
            f"handle names Mooncake session {handle.session_id!r} but {worker.worker_id} registered "
            f"{session!r} (stale worker incarnation?)"
        )
    if not handle.page_ids:
        raise HandleError(f"handle {handle.handle_id} reserves no pages")
    bad = [p for p in handle.page_ids if not 0 <= p < geometry.num_pages]
    if bad:
        raise HandleError(
            f"page ids {bad[:8]} outside {worker.worker_id}'s pool of {geometry.num_pages} pages"
        )
    if handle.lease_expires_ms <= now_ms:
        raise HandleError(
            f"lease of handle {handle.handle_id} already expired ({now_ms - handle.lease_expires_ms} ms ago)"
        )
    if handle.lease_expires_ms - now_ms > max_lease_ms:
        raise HandleError(
            f"lease of {handle.lease_expires_ms - now_ms} ms exceeds the broker's limit of {max_lease_ms} ms"
        )
    return HandleRecord(handle=handle, state=HandleState.RESERVED, updated_ms=now_ms)


def _refuse_if_dead(rec: HandleRecord, now_ms: int, action: str) -> None:
    if rec.state == HandleState.EXPIRED or overdue(rec, now_ms):
        raise HandleError(f"handle {rec.handle.handle_id} lease expired; cannot mark it {action}")


def written(rec: HandleRecord, now_ms: int) -> HandleRecord:
    _refuse_if_dead(rec, now_ms, "written")
    if rec.state == HandleState.WRITTEN:
        return rec
    if rec.state != HandleState.RESERVED:
        raise HandleError(
            f"handle {rec.handle.handle_id} is {rec.state.name.lower()}; cannot mark it written"
        )
    return HandleRecord(handle=rec.handle, state=HandleState.WRITTEN, updated_ms=now_ms)


def consumed(rec: HandleRecord, now_ms: int) -> HandleRecord:
    if rec.state == HandleState.CONSUMED:
        return rec
    _refuse_if_dead(rec, now_ms, "consumed")
    return HandleRecord(handle=rec.handle, state=HandleState.CONSUMED, updated_ms=now_ms)


def of_old_incarnation(rec: HandleRecord, worker: WorkerRecord) -> bool:
    """A live handle into `worker`'s pool made for an earlier process of it (another session)."""
    h = rec.handle
    return rec.state in LIVE and h.decode_worker == worker.worker_id and h.session_id not in sessions(worker)


def expire(rec: HandleRecord, now_ms: int, old_incarnation: bool = False) -> HandleRecord:
    if not (overdue(rec, now_ms) or (old_incarnation and rec.state in LIVE)):
        raise HandleError(f"handle {rec.handle.handle_id} is {rec.state.name.lower()}, not past its lease")
    return HandleRecord(handle=rec.handle, state=HandleState.EXPIRED, updated_ms=now_ms)


@dataclass
class SweepPlan:
    expire: list[str] = field(default_factory=list)  # overdue live handles
    forget: list[str] = field(default_factory=list)  # consumed/expired past retention
    next_due_ms: int | None = None  # when something next comes due (None: nothing pending)


def plan_sweep(records: Iterable[tuple[str, HandleRecord]], now_ms: int, retention_ms: int) -> SweepPlan:
    plan = SweepPlan()
    for key, rec in records:
        if rec.state in LIVE:
            due = rec.handle.lease_expires_ms
            target = plan.expire
        else:
            due = rec.updated_ms + retention_ms
            target = plan.forget
        if now_ms >= due:
            target.append(key)
        elif plan.next_due_ms is None or due < plan.next_due_ms:
            plan.next_due_ms = due
    return plan
