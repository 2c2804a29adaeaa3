"""The gateway's /ready through the real mesh (nats-server, kv-broker, scheduler, gateway and a decode
worker as processes): 503 with the reason until the decode worker's first heartbeat, 200 once it is
heard (a request is then served, prefilled on the decode worker: no prefill worker runs), 503 again
after it is killed; /health (liveness) stays 200 throughout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats
import pytest

from libs.launch.mesh import Mesh, MeshConfig
from proto import decoder, subjects
from proto import messages as m

pytestmark = pytest.mark.e2e

DEADLINE_S = 120.0  # the decode worker's start (torch import, model load) on a loaded 2-core machine


async def poll_ready(
    http: httpx.AsyncClient, mesh: Mesh, status: int, seen: list[tuple[float, int]], all_alive: bool = True,
    schedulers: int | None = None,
) -> dict:
    """GET /ready until it answers `status` (and, if given, counts that many schedulers: the gateway hears
    the scheduler's heartbeat on its own, a moment after the launcher did); every answer goes to `seen` as
    (wall ms received, status). `all_alive`: a service the launcher gives up on meanwhile fails the test with
    its log."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        r = await http.get("/ready")
        seen.append((time.time() * 1000, r.status_code))
        if r.status_code == status and (schedulers is None or r.json().get("schedulers") == schedulers):
            return r.json()
        if all_alive:
            mesh.check_serviceable()
        assert time.monotonic() < deadline, f"/ready not {status} in {DEADLINE_S} s: {r.json()}"
        await asyncio.sleep(0.02)  # the poll interval; the condition is /ready's answer


async def test_ready_follows_the_decode_workers_heartbeats(tiny_model: Path, tmp_path: Path) -> None:
    cfg = MeshConfig(model_dir=tiny_model, port=0, prefill_workers=0, decode_workers=1, log_dir=tmp_path)
    mesh = Mesh(cfg)
    await asyncio.to_thread(mesh.start, DEADLINE_S, {"decode-0"})  # waits for the scheduler and gateway
    beats: list[int] = []  # sent_ms of decode-0's heartbeats, as this test hears them
    hb = decoder(m.Heartbeat)
    nc = await nats.connect(mesh.nats_url, **mesh.connect_options())
    try:

        async def on_beat(msg) -> None:
            beat = hb.decode(msg.data)
            if isinstance(beat, m.WorkerHeartbeat) and beat.worker_id == "decode-0":
                beats.append(beat.sent_ms)

        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
        await nc.flush()
        async with httpx.AsyncClient(base_url=mesh.url, timeout=10) as http:
            seen: list[tuple[float, int]] = []
            before = await poll_ready(http, mesh, 503, seen, schedulers=1)
            assert (
                before["error"]["code"] == "not_ready"
                and before["error"]["type"] == "service_unavailable_error"
            )
            assert before["error"]["message"] == f"no live decode worker for model {mesh.model_name!r}"
            assert (before["decode_workers"], before["schedulers"]) == (0, 1)
            assert (await http.get("/health")).status_code == 200  # liveness does not wait for workers

            mesh.release("decode-0")
            ready = await poll_ready(http, mesh, 200, seen)
            async with asyncio.timeout(10):  # the heartbeat the gateway heard reaches this test too
                while not beats:
                    await asyncio.sleep(0.01)
            first = min(beats)
            answers_before_it = {status for at, status in seen if at < first}
            assert answers_before_it == {503}, seen  # nothing was ready before the first heartbeat left
            assert ready["status"] == "ready" and ready["decode_workers"] == 1
            assert ready["prefill_workers"] == 0 and ready["prompt_path"] == "decode-local prefill"
            side = f"http://{cfg.host}:{mesh.side_port('decode-0')}/ready"
            worker = await http.get(side)  # the worker: model loaded, KV pool registered
            assert worker.status_code == 200 and worker.json()["instance"] == "decode-0"
            done = await http.post(
                "/v1/completions", json={"model": mesh.model_name, "prompt": "Hello there", "max_tokens": 2}
            )
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2

            await asyncio.to_thread(mesh.sup.kill, "decode-0")  # SIGKILL: no WorkerGone, only silence
            after = await poll_ready(http, mesh, 503, seen, all_alive=False)
            assert after["error"]["message"] == f"no live decode worker for model {mesh.model_name!r}"
            assert (await http.get("/health")).status_code == 200
    finally:
        await nc.close()
        await asyncio.to_thread(mesh.stop)
