"""A scheduler hosted in the gateway's process (`embedded_scheduler`), as Dynamo's frontend hosts its router."""

# Opt-in: it saves the gateway's own submits a bus hop each way (on a loaded small machine most of a hop is
# waking another process). It is a full scheduler replica all the same: its own bus connection, a member of
# the SCHED_SUBMIT queue group (other gateways' submits and failover reach it as any replica), its own
# heartbeat; only the host gateway's submits come in directly (`MeshClient` through `submit`).
#
# Settings: `MOEMESH_SCHEDULER_*` as for a scheduler process, except what ties it to its host: the NATS
# connection (URL, credentials, TLS) is the gateway's, and without an `instance_id` it is named
# `scheduler-<gateway id>`. Life: started before the gateway takes work (a failed start fails the
# gateway's), stopped after the gateway's HTTP has drained; if it ends on its own the gateway stops too,
# so the supervisor restarts the pair.
#
# The one place a service imports another: the two still meet only through proto messages (Submit,
# SubmitReply), the scheduler side through `SchedulerService.submit_local`.

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from libs.bus.settings import load_settings
from proto.messages import Submit, SubmitReply
from services.gateway.settings import GatewaySettings
from services.scheduler.service import SchedulerService, SchedulerSettings

log = logging.getLogger("moemesh.gateway.scheduler")

# the host's connection: one NATS server and one set of credentials for the whole process
_CONNECTION = (
    "nats_url", "nats_user", "nats_password", "nats_token", "nats_tls_ca", "nats_tls_cert", "nats_tls_key",
    "connect_timeout_s",
)  # fmt: skip


def embedded_settings(
    gateway: GatewaySettings, gateway_id: str, env: Mapping[str, str] | None = None
) -> SchedulerSettings:
    """The embedded scheduler's settings: MOEMESH_SCHEDULER_* from `env` (os.environ), the host's connection."""
    own = load_settings(SchedulerSettings, "scheduler", [], env)
    tied: dict[str, object] = {f: getattr(gateway, f) for f in _CONNECTION}
    return msgspec.structs.replace(own, instance_id=own.instance_id or f"scheduler-{gateway_id}", **tied)


class SchedulerFamilies:
    """A prometheus collector for the host's registry: the hosted scheduler's own families (moemesh_scheduler_*),
    so the gateway's /metrics carries them (it has no side port of its own). The families every service has
    (moemesh_service_ready, moemesh_bus_*) stay the gateway's: one name cannot appear twice in a scrape."""

    PREFIX = "moemesh_scheduler_"

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (fam for fam in self.registry.collect() if fam.name.startswith(self.PREFIX))


class EmbeddedScheduler:
    """A SchedulerService running in this event loop; `MeshClient`'s `LocalScheduler`."""

    def __init__(self, settings: SchedulerSettings, on_exit: Callable[[], None]) -> None:
        self.service = SchedulerService(settings)
        self._on_exit = on_exit  # called when it ends without being asked to (the gateway stops)
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def instance_id(self) -> str:
        return self.service.instance_id

    async def start(self) -> None:
        """Connect and set it up; returns once it takes work. A setup error raises here."""
        svc = self.service
        self._task = asyncio.create_task(svc.run(install_signals=False), name="embedded-scheduler")
        started = asyncio.create_task(svc.started.wait())
        await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        if not svc.started.is_set():
            started.cancel()
            await self._task  # raises why it did not start
            raise RuntimeError("the embedded scheduler ended before it started")
        self._task.add_done_callback(self._ended)
        log.info("embedded scheduler %s started", svc.instance_id)

    def _ended(self, task: asyncio.Task) -> None:
        if self._stopping:
            return
        error = None if task.cancelled() else task.exception()
        log.error("embedded scheduler %s ended unasked (%r): stopping the gateway", self.instance_id, error)
        self._on_exit()

    def taking_work(self) -> bool:
        return self.service.healthy()

    async def submit(self, msg: Submit, timeout: float) -> SubmitReply:
        return await self.service.submit_local(msg, timeout)

    async def stop(self) -> None:
        """Drain it as a scheduler process drains on SIGTERM (placements finish, what is queued fails)."""
        self._stopping = True
        if self._task is None:
            return
        self.service.request_stop()
        await asyncio.gather(self._task, return_exceptions=True)
