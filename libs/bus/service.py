"""The service shell: NATS connection, subscriptions, signals, graceful drain, GC pause metrics, tracing, and
an HTTP side port (/ready, /health, /livez, /metrics, /settings; docs/operations.md). A service subclasses
`Service` (`name`, `settings_class`), subscribes in `setup()`, cleans up in `on_drain()`; `main()` runs it."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from libs.bus.bus import Bus, BusError
from libs.bus.loop import run as run_loop
from libs.bus.periodic import Periodic
from libs.bus.ports import write_ports
from libs.bus.security import nats_connect_options, redact_url
from libs.bus.settings import ServiceSettings, SettingsError, load_settings, settings_json
from libs.telemetry.gc_pauses import GcPauses, freeze_startup_heap
from libs.telemetry.heap_report import HeapReport, can_trim, set_arena_max, trim_heap

log = logging.getLogger("moemesh.service")


class Service:
    """Base of every moemesh service. Construct with its settings; `await run()` serves until stopped."""

    name: ClassVar[str] = "service"
    settings_class: ClassVar[type[ServiceSettings]] = ServiceSettings

    def __init__(self, settings: ServiceSettings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.instance_id = settings.instance_id or f"{self.name}-{secrets.token_hex(4)}"
        self.registry = registry if registry is not None else CollectorRegistry()
        self._bus: Bus | None = None
        self._ready = False
        self.draining = False
        self.started = asyncio.Event()  # set once setup() is done and the service is ready
        self.startup_stage = "connecting to NATS"  # what /ready names while setup() runs
        self.stopping = asyncio.Event()
        self.exit_code = 0  # main()'s: 1 after fail()
        self.freeze_heap_when_set_up = False  # main(): this process is the service's own
        self.gc_pauses = GcPauses(self.registry)
        self.http_port: int | None = None  # the bound port, once run() started the side port
        self.heap_report: HeapReport | None = None  # heap_report_s > 0: the heap, reported periodically
        self._heap_reports: Periodic | None = None
        self._heap_trims: Periodic | None = None  # malloc_trim_s > 0 on glibc
        self._ready_gauge = Gauge(
            "moemesh_service_ready", "1 when this instance takes work", registry=self.registry
        )
        from libs.telemetry.tracing import Telemetry  # here: libs.telemetry itself imports libs.bus

        # Tracing from the OTEL_* environment (a no-op without an endpoint); replace before run() to
        # send the spans elsewhere (tests use an in-memory exporter).
        self.telemetry = Telemetry.from_env(self.name, self.instance_id)

    # --- hooks for subclasses ---
    async def setup(self) -> None:
        """Subscribe and prepare state; the bus is connected. Raising here aborts run()."""

    async def on_drain(self) -> None:
        """Called after subscriptions stopped and handlers finished, while the connection is still up
        (e.g. publish WorkerGone, cancel background tasks)."""

    def is_ready(self) -> bool:
        """Extra readiness condition on top of 'connected, set up, not draining'."""
        return True

    def not_ready_reason(self) -> str | None:
        """Why this set-up, connected instance takes no work now (None: it does); /ready's 503 says it."""
        return None if self.is_ready() else f"{self.name} is not ready"

    def bound_ports(self) -> dict[str, int]:
        """The ports this instance listens on, by role, as written to `ports_file`."""
        return {} if self.http_port is None else {"http": self.http_port}

    # --- state ---
    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError(f"{self.name}: bus used before run() connected it")
        return self._bus

    def healthy(self) -> bool:
        return (
            self._bus is not None
            and self._bus.is_connected
            and self._ready
            and not self.draining
            and self.is_ready()
        )

    def unready_reason(self) -> str | None:
        """Why /ready is 503 (None: 200)."""
        if self.draining:
            return f"{self.name} is draining"
        if self._bus is None or not self._bus.is_connected:
            return f"{self.name} is not connected to NATS"
        if not self._ready:
            return f"{self.name} is starting: {self.startup_stage}"
        return self.not_ready_reason()

    def request_stop(self) -> None:
        """Begin the graceful drain (what SIGINT/SIGTERM do)."""
        self.stopping.set()

    def essential(self, task: asyncio.Task, what: str) -> asyncio.Task:
        """`task` runs until the drain: if it ends before, the service fails (and is restarted)."""

        def ended(t: asyncio.Task) -> None:
            if not t.cancelled() and not self.draining:
                self.fail(f"{what} ended", t.exception())

        task.add_done_callback(ended)
        return task

    def fail(self, why: str, exc: BaseException | None = None) -> None:
        """A part the service cannot run without has ended: drain, then exit 1 (a supervisor restarts it)."""
        log.critical("%s %s: %s; stopping", self.name, self.instance_id, why, exc_info=exc)
        self.exit_code = 1
        self.request_stop()

    # --- lifecycle ---
    async def run(self, install_signals: bool = True) -> None:
        """Connect, set up, serve until stopped, then drain gracefully (see the module docstring)."""
        s = self.settings
        if s.heap_report_s > 0:
            self.heap_report = HeapReport(frames=s.heap_report_frames)
            self.heap_report.start()
        self._bus = await Bus.connect(
            s.nats_url, f"{self.name}:{self.instance_id}", connect_deadline=s.connect_timeout_s,
            drain_timeout=s.drain_timeout_s, registry=self.registry, **nats_connect_options(s),
        )  # fmt: skip
        http = await self._start_http() if s.http_port != 0 else None
        signals = self._install_signals() if install_signals else []
        try:
            self.gc_pauses.install()  # uninstalled in _shutdown
            self.startup_stage = "setting up"
            await self.setup()
            await self.bus.flush()  # subscriptions are known to the server before anyone is told we are ready
            if s.ports_file:  # a launcher that asked for any free port learns which one it got
                write_ports(s.ports_file, self.bound_ports())
            # Frozen, the start-up heap (model, tokenizer, imports) leaves the oldest generation's
            # collections, whose walk of a worker's whole heap would stall whichever decode step met it.
            if self.freeze_heap_when_set_up and s.gc_freeze:  # after the ports: a worker heartbeats already
                t0 = time.perf_counter()
                frozen = freeze_startup_heap()
                log.info(
                    "%s %s: start-up heap frozen (%d objects, %.2f s)",
                    self.name, self.instance_id, frozen, time.perf_counter() - t0,
                )  # fmt: skip
            if self.heap_report is not None:  # the baseline: the set-up heap
                self.heap_report.mark_ready()
                self._heap_reports = Periodic(s.heap_report_s, self._report_heap, "heap-report")
                self._heap_reports.start()
            if s.malloc_trim_s > 0 and can_trim():
                self._heap_trims = Periodic(s.malloc_trim_s, self._trim_heap, "malloc-trim")
                self._heap_trims.start()
            self._ready = True
            self._ready_gauge.set(1)
            self.started.set()
            log.info(
                "%s %s ready (nats %s, http %s)",
                self.name,
                self.instance_id,
                redact_url(s.nats_url),
                self.http_port,
            )
            await self.stopping.wait()
        finally:
            await self._shutdown(http, signals)

    async def _trim_heap(self) -> None:  # off the event loop: a trim walks every arena
        await asyncio.get_running_loop().run_in_executor(None, trim_heap)

    async def _report_heap(self) -> None:
        if self.heap_report is not None:
            self.heap_report.report()

    async def _shutdown(self, http: asyncio.Server | None, signals: list[int]) -> None:
        # Order: /health turns 503; unsubscribe (queue-group peers take new work); delivered messages and
        # running handlers finish (up to drain_timeout_s); on_drain(); the connection drains; HTTP closes.
        self.draining = True
        self._ready_gauge.set(0)
        log.info("%s %s draining", self.name, self.instance_id)
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.remove_signal_handler(sig)
        for periodic in (self._heap_reports, self._heap_trims):
            if periodic is not None:
                await periodic.stop()
        bus = self.bus
        try:
            await bus.stop_subscriptions(self.settings.drain_timeout_s)
            try:
                await self.on_drain()
            except Exception:
                log.exception("%s on_drain failed", self.name)
            await bus.drain()
        finally:
            await bus.close()
            if http is not None:
                http.close()
                await http.wait_closed()
            await self.telemetry.aclose()  # export the last spans
            self.gc_pauses.uninstall()
            log.info("%s %s stopped", self.name, self.instance_id)

    def _install_signals(self) -> list[int]:
        loop = asyncio.get_running_loop()
        installed: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.request_stop)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
                log.debug("cannot install handler for %s", sig)
        return installed

    # --- HTTP side port ---
    async def _start_http(self) -> asyncio.Server:
        port = max(self.settings.http_port, 0)
        server = await asyncio.start_server(self._serve_http, self.settings.http_host, port)
        self.http_port = server.sockets[0].getsockname()[1]
        return server

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.decode("latin-1").split()
            method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            path, _, query = target.partition("?")
            status, ctype, body = self._route(method, path, query)
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + (body if method != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _route(self, method: str, path: str, query: str = "") -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path in ("/health", "/healthz", "/readyz"):
            ok = self.healthy()
            body = {
                "status": "ok" if ok else "unavailable",
                "service": self.name,
                "instance": self.instance_id,
                "connected": self._bus is not None and self._bus.is_connected,
                "draining": self.draining,
            }
            return (
                ("200 OK" if ok else "503 Service Unavailable"),
                "application/json",
                json.dumps(body).encode(),
            )
        if path == "/ready":
            return self._ready_response()
        if path == "/livez":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/settings":  # the effective settings, secrets masked
            return "200 OK", "application/json", json.dumps(settings_json(self.settings)).encode()
        if path == "/metrics":  # `?name[]=x&name[]=y`: those series only, as prometheus_client's own server
            names = parse_qs(query).get("name[]")
            registry = self.registry.restricted_registry(names) if names else self.registry
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
        return "404 Not Found", "text/plain", b"not found\n"

    def _ready_response(self) -> tuple[str, str, bytes]:
        reason = self.unready_reason()
        where = {"service": self.name, "instance": self.instance_id}
        if reason is None:
            return "200 OK", "application/json", json.dumps({"status": "ready", **where}).encode()
        error = {"message": reason, "type": "service_unavailable_error", "param": None, "code": "not_ready"}
        body = {"error": error, "status": "unavailable", **where}  # OpenAI's error shape
        return "503 Service Unavailable", "application/json", json.dumps(body).encode()

    # --- entry point ---
    @classmethod
    def main(cls, argv: Sequence[str] | None = None) -> int:
        """`python -m services.<name>`: settings from env + flags, logging, run until a signal."""
        try:
            settings = load_settings(cls.settings_class, cls.name, sys.argv[1:] if argv is None else argv)
        except SettingsError as e:
            print(f"{cls.name}: {e}", file=sys.stderr)
            return 2
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        # `kill -USR1 <pid>`: every thread's Python stack to stderr (the service's log), the service runs on;
        # what a stuck request is waiting on (a KV write, the engine thread) shows without a debugger
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        if (arenas := settings.arena_max()) > 0 and set_arena_max(arenas):  # before the service's threads
            log.info("%s: glibc malloc arenas at most %d", cls.name, arenas)
        try:
            service = cls(settings)
            service.freeze_heap_when_set_up = True
            run_loop(service.run(), settings.event_loop)
        except KeyboardInterrupt:
            pass
        except BusError as e:  # NATS unreachable within connect_timeout_s: say so, no traceback
            log.error("%s: %s", cls.name, e)
            return 1
        return service.exit_code
