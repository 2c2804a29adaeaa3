from prometheus_client import CollectorRegistry, generate_latest

from proto import messages as m
from services.gateway.launcher import LauncherCollector, LauncherView


def status(launcher: str, sent: int, **states: tuple[m.ServiceStatus, int]) -> m.LauncherStatus:
    services = [m.ServiceState(name=n, status=s, restarts=r) for n, (s, r) in states.items()]
    return m.LauncherStatus(launcher_id=launcher, services=services, interval_ms=1000, sent_ms=sent)


def test_metrics_show_each_service_status_and_restarts_and_drop_a_silent_launcher() -> None:
    view, now = LauncherView(), [100.0]
    registry = CollectorRegistry()
    registry.register(LauncherCollector(view, clock=lambda: now[0]))
    view.observe(
        status("L1", 1, decode_0=(m.ServiceStatus.UP, 1), prefill_0=(m.ServiceStatus.GIVEN_UP, 5)), 100.0
    )
    text = generate_latest(registry).decode()
    assert 'moemesh_launcher_service_status{launcher="L1",service="decode_0",status="up"} 1.0' in text
    assert 'moemesh_launcher_service_status{launcher="L1",service="decode_0",status="restarting"} 0.0' in text
    assert 'moemesh_launcher_service_status{launcher="L1",service="prefill_0",status="given_up"} 1.0' in text
    assert 'moemesh_launcher_service_restarts{launcher="L1",service="decode_0"} 1.0' in text
    now[0] = 100.0 + 3.5  # three intervals without a status: the launcher is gone
    assert "L1" not in generate_latest(registry).decode()
