"""bench.tune_gemm on the tiny model on the CPU: every warm-up stage of a worker that prefills and decodes
runs through the Engine in order and is recorded; nothing is tuned off a GPU, so no table is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_tune_gemm_runs_each_warmup_stage(tmp_path, monkeypatch) -> None:
    from bench import tune_gemm

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    table_dir = tmp_path / "tables"
    rec = tune_gemm.main(["--smoke", "--device", "cpu", "--concurrency", "2", "--table-dir", str(table_dir)])
    names = [s["stage"] for s in rec["stages"]]
    prefill = [int(n.split()[1]) for n in names if n.startswith("prefill")]
    assert prefill[:11] == [1 << i for i in range(11)] and prefill == sorted(prefill)  # up to what the pool holds
    assert names[len(prefill) :] == ["decode 1", "decode 2"]
    assert all(s["s"] > 0 and s["tuned"] == 0 for s in rec["stages"])
    assert rec["tuned"] == 0 and not table_dir.exists()
    (written,) = Path(tmp_path / "out").glob("tune_gemm-*.json")
    assert json.loads(written.read_text())[0]["benchmark"] == "tune_gemm"
