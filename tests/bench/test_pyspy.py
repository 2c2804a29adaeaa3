"""bench/pyspy.py: folding py-spy's raw samples into each thread's hottest functions, and a real py-spy
recording of a busy Python process where py-spy is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pyspy import Profile, executable, summarize

RAW = """\
thread (1): MainThread;main (app.py:10);loop (app.py:20);step (engine.py:5) 6
thread (1): MainThread;main (app.py:10);loop (app.py:21);publish (bus.py:7) 3
thread (1): MainThread;main (app.py:10);recurse (app.py:30);recurse (app.py:31) 1
thread (2): engine_0;run (thread.py:1);forward (model.py:9) 4
"""


def test_summary_shares_are_per_thread_and_count_a_function_once_per_stack() -> None:
    s = summarize(RAW)
    main, eng = s["thread (1): MainThread"], s["thread (2): engine_0"]
    assert main["samples"] == 10 and eng["samples"] == 4
    top = dict(main["top"])
    assert top["main (app.py)"] == 1.0 and top["loop (app.py)"] == 0.9 and top["step (engine.py)"] == 0.6
    assert top["recurse (app.py)"] == 0.1  # on one stack twice: counted once
    assert dict(eng["top"]) == {"run (thread.py)": 1.0, "forward (model.py)": 1.0}
    assert dict(main["self"]) == {"step (engine.py)": 0.6, "publish (bus.py)": 0.3, "recurse (app.py)": 0.1}
    assert dict(eng["self"]) == {"forward (model.py)": 1.0}


def test_without_py_spy_the_profile_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no py-spy beside it either
    assert Profile.start(1, tmp_path / "x.txt").stop() == {"error": "py-spy is not installed"}


@pytest.mark.skipif(executable() is None, reason="py-spy is not installed")
def test_a_busy_process_shows_its_hot_function(tmp_path: Path) -> None:
    code = "def hot():\n    while True:\n        sum(range(1000))\nhot()\n"
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        prof = Profile.start(busy.pid, tmp_path / "busy.txt", rate=100, max_s=2)
        assert prof.proc is not None
        prof.proc.wait(timeout=30)  # a 2 s recording ends by itself and writes its file
        out = prof.stop()
    finally:
        busy.kill()
        busy.wait()
    if "error" in out and "ermission" in out["error"]:
        pytest.skip(f"no ptrace rights here: {out['error']}")
    assert "error" not in out, out
    (thread,) = out["threads"].values()
    assert dict(thread["top"]).get("hot (<string>)", 0) > 0.5, thread
