"""The supervisor with real child processes (tiny Python one-liners, not the mesh's services)."""

import sys
import time
from pathlib import Path

import pytest

from libs.launch.restart_policy import RestartPolicy, State
from libs.launch.supervisor import ServiceSpec, Supervisor

FAST = RestartPolicy(backoff_s=0.0, max_backoff_s=0.0, max_restarts=2, window_s=60.0)


def spec(name: str, code: str) -> ServiceSpec:
    return ServiceSpec(name, "", argv=(sys.executable, "-c", code))


def poll_until(sup: Supervisor, done, timeout: float = 20.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, (lines, sup.summary())
        lines += sup.poll()
        time.sleep(0.02)  # child processes exit on their own schedule
    return lines


def test_a_crash_looping_service_is_given_up_with_its_log_tail_while_others_stay_up(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, FAST)
    sup.start(spec("crashy", "import sys; print('bad setting XYZ', flush=True); sys.exit(3)"))
    sup.start(spec("steady", "import time; time.sleep(60)"))
    try:
        lines = poll_until(sup, lambda: sup.state("crashy") is State.GIVEN_UP)
        assert sup.restarts("crashy") == FAST.max_restarts
        assert sum("crashy restarted" in line for line in lines) == FAST.max_restarts
        give_up = next(line for line in lines if "GIVING UP" in line)
        assert "exited with code 3" in give_up and "bad setting XYZ" in give_up  # the log tail
        assert (tmp_path / "crashy.log").read_text().count("bad setting XYZ") == FAST.max_restarts + 1
        assert sup.state("steady") is State.UP and sup.procs["steady"].alive
        assert "given up: crashy" in sup.summary()
    finally:
        sup.stop_all(grace_s=5)
    assert not sup.procs["steady"].alive and sup.state("steady") is State.STOPPED


def test_a_killed_service_comes_back_as_a_new_process(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, FAST)
    first = sup.start(spec("svc", "import time; time.sleep(60)")).proc.pid
    try:
        sup.kill("svc")
        lines = poll_until(sup, lambda: sup.restarts("svc") == 1)
        assert "killed by signal 9" in lines[0]
        assert sup.state("svc") is State.UP and sup.procs["svc"].alive and sup.procs["svc"].proc.pid != first
    finally:
        sup.stop_all(grace_s=5)
    assert sup.poll() == []  # stopping is not a crash: nothing restarts


def test_a_restart_runs_the_spec_given_by_respec(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, FAST)
    sup.start(spec("svc", "import time; print('life 1', flush=True); time.sleep(60)"))
    try:
        poll_until(sup, lambda: "life 1" in sup.procs["svc"].log_tail())
        sup.respec("svc", spec("svc", "import time; print('life 2', flush=True); time.sleep(60)"))
        assert sup.procs["svc"].alive  # the running process is left as it is
        sup.kill("svc")
        poll_until(sup, lambda: sup.restarts("svc") == 1 and "life 2" in sup.procs["svc"].log_tail())
        assert (tmp_path / "svc.log").read_text().count("life 1") == 1
        with pytest.raises(ValueError, match="other"):
            sup.respec("svc", spec("other", "pass"))
    finally:
        sup.stop_all(grace_s=5)


def test_stop_all_stops_the_last_group_after_the_others(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, FAST)
    ends = tmp_path / "ends"
    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    open({str(ends)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    for name in ("bus", "a", "b"):
        sup.start(ServiceSpec(name, "", argv=(sys.executable, "-c", code, name)))
    poll_until(sup, lambda: all("ready" in p.log_tail() for p in sup.procs.values()))
    sup.stop_all(grace_s=5, last=("bus",))
    order = ends.read_text().split()
    assert sorted(order[:2]) == ["a", "b"] and order[2] == "bus"
