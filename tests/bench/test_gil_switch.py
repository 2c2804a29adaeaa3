"""bench/gil_switch.py: an event loop's round trips beside a spinning thread, per GIL switch interval."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import gil_switch


def test_records_round_trips_per_interval_and_restores_the_interval(tmp_path: Path) -> None:
    before = sys.getswitchinterval()
    rec = gil_switch.main(["--intervals-ms", "2,0.2", "--pings", "20", "--output", str(tmp_path / "g.json")])
    assert sys.getswitchinterval() == before
    assert [(r["interval_ms"], r["busy_thread"]) for r in rec["runs"]] == [(2, False), (2, True), (0.2, True)]
    for r in rec["runs"]:
        assert r["pings"] == 20 and 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
    assert all(r["busy_thread_loops_per_s"] > 0 for r in rec["runs"][1:])
    assert (tmp_path / "g.json").is_file()
