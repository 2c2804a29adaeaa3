"""The crash report `make test` prints for a dead xdist worker names how the process ended."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.worker_exit import describe_status, oom_kills, report, worker_returncode


def test_a_killed_process_is_named_by_its_signal_and_an_exit_by_its_code() -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.send_signal(signal.SIGKILL)
    node = SimpleNamespace(gateway=SimpleNamespace(id="gw7", _io=SimpleNamespace(popen=killed)))
    assert describe_status(worker_returncode(node)) == "killed by SIGKILL (9)"
    exited = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    node = SimpleNamespace(gateway=SimpleNamespace(_io=SimpleNamespace(popen=exited)))
    assert describe_status(worker_returncode(node)) == "exited with code 3"
    assert worker_returncode(SimpleNamespace(gateway=SimpleNamespace())) is None
    text = report("gw7", -9, oom_kills())
    assert text.splitlines()[0] == "[gw7] worker process killed by SIGKILL (9)"
    assert "MiB available; OOM kills since the run began:" in text.splitlines()[1]
    assert text.splitlines()[1].endswith(": unknown") == (oom_kills() is None)


def test_oom_kills_read_from_vmstat_or_either_cgroup_version(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 12\noom_kill 7\nnr_free_pages 3\n")
    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v2.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_kills((vmstat, v2, v1)) == 7
    assert oom_kills((v2, v1)) == 2
    assert oom_kills((tmp_path / "missing", v1)) == 5
    assert oom_kills((tmp_path / "missing",)) is None
