"""Small factories for broker tests."""

from __future__ import annotations

import uuid

from proto import messages as m

NOW = 1_000_000


def geometry(num_pages: int = 64) -> m.KvGeometry:
    return m.KvGeometry(
        num_layers=4, num_pages=num_pages, page_size=16, page_bytes=16 * 576 * 2, layer_stride=num_pages * 16 * 576 * 2,
        base_addr=0x7F0000000000, dtype="bfloat16",
    )  # fmt: skip


def worker(
    worker_id: str = "decode-a", session: str = "127.0.0.1:15000", num_pages: int = 64
) -> m.WorkerRecord:
    return m.WorkerRecord(
        worker_id=worker_id, role=m.Role.DECODE, session_id=session, geometry=geometry(num_pages)
    )


def register(w: m.WorkerRecord) -> m.RegisterWorker:
    return m.RegisterWorker(worker_id=w.worker_id, role=w.role, session_id=w.session_id, geometry=w.geometry)


def handle(
    lease_expires_ms: int,
    w: m.WorkerRecord | None = None,
    pages: list[int] | None = None,
    handle_id: str | None = None,
) -> m.KvHandle:
    w = w or worker()
    return m.KvHandle(
        handle_id=handle_id or uuid.uuid4().hex, request_id=f"req-{uuid.uuid4().hex[:8]}", decode_worker=w.worker_id,
        session_id=w.session_id, page_ids=pages if pages is not None else [0, 1, 2], num_tokens=40,
        lease_expires_ms=lease_expires_ms,
    )  # fmt: skip
