"""Which services the embedded launcher (`moemesh up`) has up, restarting or given up on, exported on
the gateway's /metrics:"""

# - `moemesh_launcher_service_status{launcher, service, status}`: 1 for the service's current status
#   (up / restarting / given_up / stopped), 0 for the others;
# - `moemesh_launcher_service_restarts{launcher, service}`: restarts since that launcher started.
#
# Learned from `LauncherStatus` on proto.subjects.LAUNCHER_STATUS; a launcher not heard from for three of
# its own intervals is dropped (it stopped, or the mesh runs under compose/Kubernetes with no launcher).
# `LauncherView` is pure; `LauncherCollector` is its Prometheus side.

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.bus.bus import Bus
from proto import messages as m
from proto import subjects

STALE_AFTER_INTERVALS = 3


class LauncherView:
    """The latest LauncherStatus per launcher (pure: the caller passes the time)."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[m.LauncherStatus, float]] = {}

    def observe(self, msg: m.LauncherStatus, now: float) -> None:
        self._latest[msg.launcher_id] = (msg, now)

    def current(self, now: float) -> list[m.LauncherStatus]:
        return [
            msg
            for msg, at in self._latest.values()
            if now - at <= STALE_AFTER_INTERVALS * msg.interval_ms / 1000
        ]


class LauncherCollector(Collector):
    def __init__(self, view: LauncherView, clock: Callable[[], float] = time.monotonic) -> None:
        self.view, self.clock = view, clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = GaugeMetricFamily(
            "moemesh_launcher_service_status",
            "1 for the service's current status under the embedded launcher (up, restarting, given_up, stopped)",
            labels=["launcher", "service", "status"],
        )
        restarts = GaugeMetricFamily(
            "moemesh_launcher_service_restarts",
            "Restarts of the service since its launcher started",
            labels=["launcher", "service"],
        )
        for msg in self.view.current(self.clock()):
            for s in msg.services:
                for st in m.ServiceStatus:
                    status.add_metric([msg.launcher_id, s.name, st.name.lower()], float(st == s.status))
                restarts.add_metric([msg.launcher_id, s.name], float(s.restarts))
        yield status
        yield restarts


async def watch_launchers(bus: Bus, registry: CollectorRegistry) -> LauncherView:
    """Subscribe to the launchers' status and export it on `registry`."""
    view = LauncherView()

    async def on_status(msg: m.LauncherStatus) -> None:
        view.observe(msg, time.monotonic())

    await bus.subscribe(subjects.LAUNCHER_STATUS, m.LauncherStatus, on_status)
    registry.register(LauncherCollector(view))
    return view
