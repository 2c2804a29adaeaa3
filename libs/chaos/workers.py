"""What the fault tests read back from the mesh: every live worker's page accounting over the admin
subject (GetStats -> WorkerStats), waiting for the leak check to settle, and metric totals from /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import nats

from proto import decoder, encode, subjects
from proto import messages as m

_SERVICE = {m.Role.PREFILL: "prefill-worker", m.Role.DECODE: "decode-worker"}


async def request_pages(
    nats_url: str, workers: Sequence[tuple[m.Role, str]], connect_options: dict[str, Any] | None = None
) -> dict[str, m.WorkerStats]:
    """WorkerStats of each (role, worker id); a worker that does not answer is left out."""
    nc = await nats.connect(nats_url, **(connect_options or {}))
    dec = decoder(m.AdminReply)
    out: dict[str, m.WorkerStats] = {}
    try:
        for role, wid in workers:
            try:
                r = await nc.request(subjects.admin(_SERVICE[role], wid), encode(m.GetStats()), timeout=5)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                continue
            reply = dec.decode(r.data)
            if reply.ok and reply.stats is not None:
                out[wid] = reply.stats
    finally:
        await nc.close()
    return out


async def wait_for_no_leaks(
    nats_url: str, workers: Sequence[tuple[m.Role, str]], timeout: float,
    connect_options: dict[str, Any] | None = None,
) -> dict[str, int]:  # fmt: skip
    """Poll until every listed worker answers with no request pages and no live request, or the timeout
    (leases of reservations whose prefill side died take that long). Returns request pages + live
    requests per worker at the end (all 0 when clean); a worker that never answered counts as -1."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await request_pages(nats_url, workers, connect_options)
        left = {
            wid: (stats[wid].request_pages + stats[wid].live_requests if wid in stats else -1)
            for _, wid in workers
        }
        if all(v == 0 for v in left.values()) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)  # polling other processes' state: there is no event to wait on


def metric_total(metrics_url: str, name: str) -> float:
    """A metric's value summed over all its label sets, from a service's /metrics (Prometheus text)."""
    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )
