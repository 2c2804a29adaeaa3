"""The whole mesh in this test process: a real nats-server, and the five services' own classes (kv-broker,
scheduler, prefill and decode workers with real Mooncake TCP between them, gateway with uvicorn) run as
asyncio tasks on one event loop in a background thread, every one with its own Telemetry sending spans
to one shared in-memory exporter. Tests talk to it as clients do: HTTP to the gateway and to each
service's /metrics side port.

Why in-process: an in-memory span exporter sees every hop's spans (each service keeps its own
`service.name` resource), and torch is imported once instead of once per worker process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.bus import Service
from libs.natsd import NatsServer, start_nats_server
from libs.telemetry import Telemetry
from services.decode_worker.service import DecodeWorker, DecodeWorkerSettings
from services.gateway.service import Gateway
from services.gateway.settings import GatewaySettings
from services.kv_broker.service import BrokerSettings, KvBroker
from services.prefill_worker.service import PrefillWorker, PrefillWorkerSettings
from services.scheduler.service import SchedulerService, SchedulerSettings
from tests.service_helpers import start_service


class InProcessMesh:
    def __init__(self, model_dir: Path, direct_threshold: int = 8) -> None:
        self.model_dir, self.direct_threshold = str(model_dir), direct_threshold
        self.exporter = InMemorySpanExporter()
        self.nats: NatsServer | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inprocess-mesh", daemon=True)
        self.services: dict[str, Service] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    # --- lifecycle ---
    def start(self, timeout: float = 60.0) -> InProcessMesh:
        self.nats = start_nats_server()
        self.thread.start()
        try:
            self.call(self._start, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def call(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 30.0) -> Any:
        """Run a coroutine on the mesh's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def _make(self) -> list[Service]:
        assert self.nats is not None
        common = {"nats_url": self.nats.url, "http_host": "127.0.0.1", "http_port": -1}
        worker = {
            "model_dir": self.model_dir,
            "device": "cpu",
            "dtype": "float32",
            "transfer_protocol": "tcp",
        }
        return [
            KvBroker(BrokerSettings(**common)),
            # prefix-unaware (load-only, no decode-side KV reuse), so the tests' traffic is routed and
            # moves KV as they count it; prefix-aware routing has tests of its own
            SchedulerService(
                SchedulerSettings(
                    **common,
                    direct_prefill_threshold=self.direct_threshold,
                    prefix_weight=0.0,
                    decode_prefix_reuse=False,
                )
            ),
            PrefillWorker(PrefillWorkerSettings(**common, **worker, instance_id="prefill-0")),
            DecodeWorker(DecodeWorkerSettings(**common, **worker, instance_id="decode-0")),
            Gateway(GatewaySettings(nats_url=self.nats.url, model_dir=self.model_dir, port=0)),
        ]

    async def _start(self) -> None:
        for svc in self._make():  # in order: the workers register at a broker that is up
            svc.telemetry = Telemetry.with_exporter(svc.name, self.exporter, svc.instance_id)
            self.tasks[svc.name] = await start_service(svc, 60)
            self.services[svc.name] = svc
        sched = self.scheduler
        await self._until(lambda: len(sched.workers.live(sched.clock())) == 2, "both workers heard", sched)

    async def _until(
        self, cond: Callable[[], bool], what: str, sched: SchedulerService | None = None
    ) -> None:
        """Wait for a condition, woken by the scheduler's changes or a short poll; fail if a service died."""
        async with asyncio.timeout(60):
            while not cond():
                for name, t in self.tasks.items():
                    if t.done():
                        raise RuntimeError(f"{name} stopped while waiting for {what}: {t.exception()!r}")
                waiter = sched.next_change() if sched else asyncio.sleep(0.02)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter, 0.25)

    def stop(self) -> None:
        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.call(self._stop, timeout=60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    async def _stop(self) -> None:
        for name in reversed(list(self.services)):
            self.services[name].request_stop()
            await asyncio.gather(self.tasks[name], return_exceptions=True)

    # --- access ---
    @property
    def scheduler(self) -> SchedulerService:
        return self.services["scheduler"]  # type: ignore[return-value]

    @property
    def prefill(self) -> PrefillWorker:
        return self.services["prefill-worker"]  # type: ignore[return-value]

    @property
    def decode(self) -> DecodeWorker:
        return self.services["decode-worker"]  # type: ignore[return-value]

    @property
    def gateway(self) -> Gateway:
        return self.services["gateway"]  # type: ignore[return-value]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def metrics_url(self, name: str) -> str:
        if name == "gateway":
            return f"{self.url}/metrics"
        return f"http://127.0.0.1:{self.services[name].http_port}/metrics"

    def settled(self) -> bool:
        """Nothing in flight anywhere: no queued/placing request, no prefill task, no decoding request."""
        s, p, d = self.scheduler, self.prefill, self.decode
        return (
            len(s.queue) == 0 and not p.active and not d.live and not d.reserved
            and self.gateway.mesh is not None and self.gateway.mesh.in_flight == 0
        )  # fmt: skip

    def wait_settled(self, timeout: float = 30.0) -> None:
        async def wait() -> None:
            await self._until(self.settled, "the mesh to settle")

        self.call(wait, timeout=timeout)
