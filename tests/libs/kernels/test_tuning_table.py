"""The GEMM tuning table: a choice tuned once is stored and reused by the next process (no candidate timed
again), shipped tables are read, the user cache wins over them, concurrent writers merge, and a stored
choice that is no longer a candidate, or a damaged file, tunes again. The clock is faked; no kernel runs
(the conftest gives each test its own table folders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libs.kernels import gemm_tuning

CANDS = ["slow", "fast", "mid"]
KEY = (0, 64, 7168, 1536, 1)


@pytest.fixture
def clock(monkeypatch) -> list[str]:
    """graph_time runs the candidate and returns its fixed time; -> the candidates timed, in order."""
    timed: list[str] = []
    speed = {"slow": 3.0, "fast": 1.0, "mid": 2.0, "other": 0.5}
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: (fn(), speed[timed[-1]])[1])
    monkeypatch.setattr(gemm_tuning, "device_tag", lambda: "Test_GPU-triton-9.9")
    return timed


def _new_process(monkeypatch) -> dict:
    """What a fresh process starts from: nothing read yet, no in-memory choice."""
    monkeypatch.setattr(gemm_tuning, "_STORED", None)
    return {}


def _cache_file() -> Path:
    folder = gemm_tuning.cache_dir()
    assert folder is not None
    return folder / "Test_GPU-triton-9.9.json"


def test_a_tuned_choice_is_reused_by_the_next_process_without_timing(monkeypatch, clock):
    assert gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="triton_config") == "fast"
    assert clock == CANDS
    assert json.loads(_cache_file().read_text())["tables"] == {"triton_config": {"0,64,7168,1536,1": "fast"}}
    cache = _new_process(monkeypatch)
    assert gemm_tuning.fastest(cache, KEY, CANDS, clock.append, table="triton_config") == "fast"
    assert clock == CANDS  # nothing timed the second time
    assert cache == {KEY: "fast"}
    # another table, or another key, is its own choice
    assert gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="split_k") == "fast"
    assert clock == CANDS * 2


def test_a_stored_choice_that_is_no_longer_a_candidate_tunes_again(monkeypatch, clock):
    gemm_tuning.fastest({}, KEY, ["other", *CANDS], clock.append, table="t")
    cache = _new_process(monkeypatch)
    assert gemm_tuning.fastest(cache, KEY, CANDS, clock.append, table="t") == "fast"
    assert clock == ["other", *CANDS, *CANDS]
    assert json.loads(_cache_file().read_text())["tables"]["t"]["0,64,7168,1536,1"] == "fast"


def test_shipped_tables_are_read_and_the_user_cache_wins(monkeypatch, tmp_path, clock):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(gemm_tuning, "SHIPPED_DIR", shipped)
    body = {"tables": {"t": {"0,64,7168,1536,1": "mid", "1,8,4096,7168,9": "slow"}}}
    (shipped / "Test_GPU-triton-9.9.json").write_text(json.dumps(body))
    gemm_tuning.cache_dir().mkdir(parents=True)
    _cache_file().write_text(json.dumps({"tables": {"t": {"1,8,4096,7168,9": "fast"}}}))
    _new_process(monkeypatch)
    assert gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="t") == "mid"
    assert gemm_tuning.fastest({}, (1, 8, 4096, 7168, 9), CANDS, clock.append, table="t") == "fast"
    assert clock == []


def test_writers_merge_their_choices(monkeypatch, clock):
    """Two processes (the prefill and decode workers of one GPU) each add their own keys to one file."""
    gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="t")
    env = {**os.environ, gemm_tuning.CACHE_ENV: str(gemm_tuning.cache_dir())}
    other = (
        "from libs.kernels import gemm_tuning as g\n"
        "g.device_tag = lambda: 'Test_GPU-triton-9.9'\n"
        "g.remember('t', (2, 16, 128, 256, 4), 'slow')\n"
        "g.remember('split_k', ('split', 0, 4, 128, 2048, 1), '2')\n"
    )
    subprocess.run([sys.executable, "-c", other], check=True, env=env, cwd=Path(__file__).parents[3])
    tables = json.loads(_cache_file().read_text())["tables"]
    assert tables == {
        "t": {"0,64,7168,1536,1": "fast", "2,16,128,256,4": "slow"},
        "split_k": {"split,0,4,128,2048,1": "2"},
    }


def test_an_empty_cache_setting_stores_nothing(monkeypatch, tmp_path, clock):
    monkeypatch.setenv(gemm_tuning.CACHE_ENV, "")
    assert gemm_tuning.cache_dir() is None
    assert gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="t") == "fast"
    _new_process(monkeypatch)
    gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="t")
    assert clock == CANDS * 2
    assert not list(tmp_path.rglob("*.json"))


def test_a_damaged_table_is_ignored_with_a_warning(monkeypatch, clock, caplog):
    gemm_tuning.cache_dir().mkdir(parents=True)
    _cache_file().write_text("{not json")
    assert gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="t") == "fast"
    assert clock == CANDS
    assert "ignoring tuning table" in caplog.text
    assert json.loads(_cache_file().read_text())["tables"] == {"t": {"0,64,7168,1536,1": "fast"}}


def test_a_key_where_every_candidate_failed_is_not_stored(monkeypatch, clock):
    def fail(c: str) -> None:
        clock.append(c)
        raise RuntimeError("no shared memory")

    assert gemm_tuning.fastest({}, KEY, CANDS, fail, table="t") == "slow"  # the first, as before
    assert not _cache_file().exists()


def test_a_nested_sweep_is_counted_once_in_the_time_spent(monkeypatch, clock):
    """The kernel choice times the Triton candidate, whose first launch runs the tile sweep: that sweep's
    seconds belong to the outer one's, not added twice."""
    monkeypatch.setattr(gemm_tuning, "SPENT", {"seconds": 0.0, "timings": 0})
    ticks = iter(range(100))
    monkeypatch.setattr(gemm_tuning.time, "perf_counter", lambda: float(next(ticks)))

    def outer(c: str) -> None:
        clock.append(c)
        gemm_tuning.fastest({}, ("inner", c), CANDS, clock.append, table="inner")

    gemm_tuning.fastest({}, KEY, ["slow", "fast"], outer, table="outer")
    assert {"seconds": 3.0, "timings": 2 + 2 * len(CANDS)} == gemm_tuning.SPENT  # outer: ticks 0 .. 3


def test_a_choice_another_process_stored_after_this_one_read_the_table_is_not_tuned_again(monkeypatch, clock):
    """The prefill and decode workers of one GPU warm up side by side: a key the other one tuned after this
    process first read the table is found in the file, not timed again."""
    gemm_tuning.fastest({}, (9,), CANDS, clock.append, table="t")  # this process has read the table
    env = {**os.environ, gemm_tuning.CACHE_ENV: str(gemm_tuning.cache_dir())}
    other = (
        "from libs.kernels import gemm_tuning as g\n"
        "g.device_tag = lambda: 'Test_GPU-triton-9.9'\n"
        "g.remember('t', (0, 64, 7168, 1536, 1), 'mid')\n"
    )
    subprocess.run([sys.executable, "-c", other], check=True, env=env, cwd=Path(__file__).parents[3])
    assert gemm_tuning.fastest({}, KEY, CANDS, clock.append, table="t") == "mid"
    assert clock == CANDS  # only the first key was timed
