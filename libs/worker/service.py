"""`WorkerService`, the base of the prefill and decode worker services: the engine on its own thread, its
KV pool exposed to the transfer fabric and announced at the kv-broker (`start_engine`, called first in
`setup`)."""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import Gauge

from libs.bus import Service
from libs.engine.protocol import EngineLike
from libs.kvtransfer import KvTransport
from libs.worker.engine_thread import EngineCallsCollector, EngineThread
from libs.worker.kv_tiers import install_kv_tiers, take_store_results
from libs.worker.settings import WorkerSettings
from libs.worker.startup import load_engine, open_transport, register_at_broker
from libs.worker.warmup import plan_warmup, run_warmup, warmup_enabled
from proto import messages as m
from proto import subjects

log = logging.getLogger("moemesh.worker")
# engine steps take milliseconds: Prometheus' default buckets (5, 10, 25 ms ...) would hide a slow step's share
STEP_BUCKETS_S = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class WorkerService(Service):
    """What the prefill and decode worker services share: the engine on its own thread, the KV pool exposed
    to the transfer fabric and announced at the kv-broker (`start_engine`, called first in `setup`)."""

    settings: WorkerSettings
    engine: EngineLike  # libs.engine.Engine, or libs.ep.engine.EPEngine for an EP group
    et: EngineThread
    transport: KvTransport

    async def start_engine(self, role: m.Role) -> None:
        s = self.settings
        subjects.check_token(self.instance_id)
        sys.setswitchinterval(s.gil_switch_interval_ms / 1000)  # the event loop beside the engine thread
        self.startup_stage = "loading the model"  # /ready says so (503) meanwhile
        self.engine = await asyncio.to_thread(load_engine, s)
        install_kv_tiers(self.engine, s, self.registry)  # the shared store joined, tier metrics
        self.et = EngineThread(self.engine)
        self.store_results = take_store_results(self.et)  # an idle worker's store puts and fetches too
        self.registry.register(EngineCallsCollector(self.et))
        await self.warm_up(role)
        self.startup_stage = "registering the KV pool (transfer engine, kv-broker)"
        self.transport = open_transport(s, self.engine)
        await register_at_broker(
            self.bus, self.instance_id, role, self.transport, self.engine, s.broker_timeout_s
        )
        self.startup_stage = "subscribing"

    async def warm_up(self, role: m.Role) -> None:
        """Kernels compiled, graphs captured, before the first heartbeat (libs/worker/warmup.py);
        its seconds in `moemesh_worker_warmup_seconds` (0: not run) and the log."""
        s = self.settings
        gauge = Gauge("moemesh_worker_warmup_seconds", "start-up warm-up (0: off)", registry=self.registry)
        if not warmup_enabled(s.warmup, s.device, s.engine):
            return
        self.startup_stage = "warming up (kernel compilation, CUDA graphs)"
        st = self.engine.stats()
        plan = plan_warmup(
            s.max_prefill_tokens, s.max_num_seqs, page_size=self.engine.page_size, free_pages=st["free_pages"],
            context_len=self.engine.config.max_position_embeddings, decode=role == m.Role.DECODE,
            copies=s.ep_size,
        )  # fmt: skip
        log.info(
            "%s warming up: prefill lengths %s, decode batches %s", self.instance_id, list(plan.prefill_lens),
            list(plan.decode_batches),
        )  # fmt: skip
        report = await self.et.call(run_warmup, self.engine, plan)
        gauge.set(report.seconds)
        log.info("%s warm-up: %.1f s, %d prompts", self.instance_id, report.seconds, report.prompts)
