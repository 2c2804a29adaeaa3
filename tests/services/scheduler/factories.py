"""Small factories for scheduler tests: heartbeats, worker tables and requests."""

from __future__ import annotations

from proto.messages import Role, Sampling, Submit, WorkerHeartbeat
from services.scheduler.policy import PlacementRequest, WorkerTable


def make_heartbeat(
    worker_id: str,
    role: Role = Role.DECODE,
    *,
    model: str = "tiny",
    running: int = 0,
    waiting: int = 0,
    free_pages: int = 64,
    total_pages: int = 64,
    page_size: int = 16,
    max_context: int = 1024,
    interval_ms: int = 1000,
    draining: bool = False,
    waiting_tokens: int = 0,
    max_running: int = 0,
    pending: int = 0,
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        role=role,
        model=model,
        running=running,
        waiting=waiting,
        free_pages=free_pages,
        total_pages=total_pages,
        page_size=page_size,
        max_context=max_context,
        interval_ms=interval_ms,
        sent_ms=0,
        draining=draining,
        waiting_tokens=waiting_tokens,
        max_running=max_running,
        pending=pending,
    )


def make_workers(
    *heartbeats: WorkerHeartbeat, now: float = 0.0, dead_after_intervals: float = 3.0
) -> WorkerTable:
    """A table with the given heartbeats; by default one decode worker d0 and one prefill worker p0."""
    table = WorkerTable(dead_after_intervals)
    for hb in heartbeats or (make_heartbeat("d0"), make_heartbeat("p0", Role.PREFILL)):
        table.observe(hb, now)
    return table


def make_request(
    prompt_len: int = 100, max_tokens: int = 16, model: str = "tiny", rid: str = "r0"
) -> PlacementRequest:
    return PlacementRequest(request_id=rid, model=model, prompt_len=prompt_len, max_tokens=max_tokens)


def make_submit(
    rid: str = "r0", prompt_len: int = 100, max_tokens: int = 16, stream: str = "mesh.stream.g0"
) -> Submit:
    return Submit(
        request_id=rid,
        model="tiny",
        prompt_ids=list(range(1, prompt_len + 1)),
        sampling=Sampling(max_tokens=max_tokens),
        stream_subject=stream,
    )
