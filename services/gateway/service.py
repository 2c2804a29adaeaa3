"""The gateway process: the Service shell (bus, signals, drain) around uvicorn serving the API."""

# Shutdown order matters here: HTTP stops first (no new requests; requests in flight may finish, up to
# drain_timeout_s), and only then does the Service shell unsubscribe the token stream and drain the bus,
# so a stream in progress keeps receiving tokens while it winds down.
#
# With `embedded_scheduler` a scheduler replica runs in this event loop (embedded_scheduler.py): started
# before the API takes requests, drained after HTTP has stopped (requests still finishing may re-submit to
# it) and before the gateway's own connection drains.

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from libs.bus.service import Service
from libs.telemetry.asgi import TracedApp
from libs.tokenizer import Tokenizer
from proto import messages as m
from proto import subjects
from services.gateway.admin import AdminMesh, install_admin
from services.gateway.app import GatewayContext, create_app
from services.gateway.convert import ModelInfo
from services.gateway.embedded_scheduler import EmbeddedScheduler, SchedulerFamilies, embedded_settings
from services.gateway.launcher import watch_launchers
from services.gateway.mesh_client import MeshClient
from services.gateway.metrics import GatewayMetrics
from services.gateway.readiness import ReadinessWatch
from services.gateway.reasoning import resolve_parser
from services.gateway.settings import GatewaySettings

log = logging.getLogger("moemesh.gateway")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the Service shell owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound TCP socket whose `proto` is IPPROTO_TCP (asyncio sets TCP_NODELAY only on accepted sockets of
    such a listener; without it every response pays Nagle + delayed ACK). With `reuse_port`, SO_REUSEPORT:
    other gateway processes of this user bind the same port and the kernel spreads connections over them."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            if not hasattr(socket, "SO_REUSEPORT"):
                raise OSError("reuse_port: this platform has no SO_REUSEPORT")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class Gateway(Service):
    name = "gateway"
    settings_class = GatewaySettings

    def __init__(self, settings: GatewaySettings, **kwargs) -> None:
        super().__init__(settings, **kwargs)
        self.settings: GatewaySettings = settings
        self.tokenizer = Tokenizer.from_pretrained(settings.model_dir)
        parser = resolve_parser(settings.reasoning_parser, self.tokenizer.chat_template)
        self.info = ModelInfo.from_dir(settings.model_dir, settings.model_name, parser)
        self.metrics = GatewayMetrics(self.registry)
        self.mesh: MeshClient | None = None
        self.admin: AdminMesh | None = None
        self.scheduler: EmbeddedScheduler | None = None  # with embedded_scheduler, once set up
        self.port: int | None = None  # the bound API port, once set up
        self._server: _Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    async def setup(self) -> None:
        s = self.settings
        if s.embedded_scheduler:  # before anything can submit: the API starts below
            self.scheduler = EmbeddedScheduler(embedded_settings(s, self.instance_id), self.request_stop)
            await self.scheduler.start()
            self.registry.register(SchedulerFamilies(self.scheduler.service.registry))  # on this /metrics
        self.mesh = MeshClient(self.bus, self.instance_id, s.dead_after_intervals, local=self.scheduler)
        await self.mesh.start(heartbeats=False)  # _on_worker_heartbeat hands them over
        mesh = self.mesh
        self.metrics.track_mesh_in_flight(lambda: mesh.in_flight)
        clock = mesh.liveness.clock  # silence measured without this process's own stalls
        self.readiness = ReadinessWatch(self.bus, self.info.name, s.dead_after_intervals, clock)
        await self.readiness.start(subscribe=False)  # /ready: a decode worker and a scheduler heard
        self.admin = AdminMesh(self.bus, clock=clock) if s.enable_admin else None
        # One subscription per heartbeat subject for the whole process (not one per user of them).
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, m.Heartbeat, self._on_worker_heartbeat)
        await self.bus.subscribe(subjects.SCHED_HEARTBEAT, m.SchedulerHeartbeat, self._on_sched_heartbeat)
        ctx = GatewayContext(
            s, self.tokenizer, self.info, mesh, self.metrics, self.healthy, readiness=self.readiness.check
        )
        # bind errors surface here, clearly, not as uvicorn's sys.exit
        sock = _bind(s.host, s.port, s.reuse_port)
        self.port = sock.getsockname()[1]
        app = create_app(ctx)
        await watch_launchers(self.bus, self.registry)  # services up/restarting/given up (launcher.py)
        if self.admin is not None:  # worker stats and the decode slow-down (admin.py)
            install_admin(app, self.admin, s.api_key)
        config = uvicorn.Config(
            TracedApp(app, self.telemetry, self.registry),  # the trace's root span, e2e latency
            log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=max(1, int(s.drain_timeout_s)),
        )  # fmt: skip
        self._server = _Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._serve_task.add_done_callback(lambda _: self._http_stopped())
        log.info(
            "gateway %s serving %s on http://%s:%d/v1 (reasoning parser: %s)", self.instance_id, self.info.name,
            s.host, self.port, self.info.reasoning_parser or "none",
        )  # fmt: skip

    async def _on_worker_heartbeat(self, msg: m.WorkerHeartbeat | m.WorkerGone) -> None:
        if msg.role == m.Role.DECODE and self.mesh is not None:
            await self.mesh.liveness.on_worker(msg)
        await self.readiness.observe(msg)
        if self.admin is not None:
            await self.admin.observe(msg)

    async def _on_sched_heartbeat(self, msg: m.SchedulerHeartbeat) -> None:
        if self.mesh is not None:
            await self.mesh.liveness.on_scheduler(msg)
        await self.readiness.observe(msg)

    def not_ready_reason(self) -> str | None:
        """The side port's /ready (replicas sharing an API port) says what the API's /ready says."""
        return self.readiness.check().reason

    def bound_ports(self) -> dict[str, int]:
        ports = super().bound_ports()
        if self.port is not None:
            ports["api"] = self.port
        return ports

    def request_stop(self) -> None:
        """Stop HTTP first; the bus drains (Service.request_stop) once uvicorn has finished."""
        if self._server is None or self._serve_task is None or self._serve_task.done():
            super().request_stop()
            return
        self._server.should_exit = True

    def _http_stopped(self) -> None:
        super().request_stop()

    async def on_drain(self) -> None:
        if self._serve_task is not None and not self._serve_task.done():
            assert self._server is not None
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serve_task
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self.mesh is not None:
            await self.mesh.wait_background()
