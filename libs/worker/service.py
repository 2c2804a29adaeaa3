"""`WorkerService`, the base of the prefill and decode worker services: the engine on its own thread, its
KV pool exposed to the transfer fabric and announced at the kv-broker (`start_engine`, called first in
`setup`)."""

from __future__ import annotations

import asyncio

from libs.bus import Service
from libs.engine.protocol import EngineLike
from libs.kvtransfer import KvTransport
from libs.worker.engine_thread import EngineThread
from libs.worker.settings import WorkerSettings
from libs.worker.startup import load_engine, open_transport, register_at_broker
from proto import messages as m
from proto import subjects


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
        self.startup_stage = "loading the model"  # /ready says so (503) meanwhile
        self.engine = await asyncio.to_thread(load_engine, s)
        self.et = EngineThread(self.engine)
        self.startup_stage = "registering the KV pool (transfer engine, kv-broker)"
        self.transport = open_transport(s, self.engine)
        await register_at_broker(
            self.bus, self.instance_id, role, self.transport, self.engine, s.broker_timeout_s
        )
        self.startup_stage = "subscribing"
