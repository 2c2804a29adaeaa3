"""The GEMM tuning table: serving never times a candidate (a key no table answers takes the caller's
default, the same in every process); the tune step (`gemm_tuning.tuning`) times what the tables lack and
writes it, and a later process reads it back; shipped tables are read, the user's win, concurrent writers
merge, a stale or damaged entry falls back. The clock is faked; no kernel runs (the conftest gives each test
its own table folders)."""

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
DEFAULT = "mid"


@pytest.fixture
def clock(monkeypatch) -> list[str]:
    """graph_time runs the candidate and returns its fixed time; -> the candidates timed, in order."""
    timed: list[str] = []
    speed = {"slow": 3.0, "fast": 1.0, "mid": 2.0, "other": 0.5}
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: (fn(), speed[timed[-1]])[1])
    monkeypatch.setattr(gemm_tuning, "device_tag", lambda: "Test_GPU-triton-9.9")
    monkeypatch.setattr(gemm_tuning, "DEFAULTED", {})
    return timed


def _pick(clock: list[str], key: tuple = KEY, table: str = "t", cands: list[str] = CANDS, cache=None) -> str:
    return gemm_tuning.choose({} if cache is None else cache, key, cands, clock.append, table, default=DEFAULT)


def _new_process(monkeypatch) -> dict:
    """What a fresh process starts from: nothing read yet, no in-memory choice."""
    monkeypatch.setattr(gemm_tuning, "_STORED", None)
    return {}


def _user_file() -> Path:
    folder = gemm_tuning.cache_dir()
    assert folder is not None
    return folder / "Test_GPU-triton-9.9.json"


def test_serving_takes_the_default_for_a_missing_key_and_never_times(monkeypatch, clock):
    def no_timing(fn):
        raise AssertionError("graph_time called while serving")

    monkeypatch.setattr(gemm_tuning, "graph_time", no_timing)
    cache: dict = {}
    assert _pick(clock, cache=cache) == DEFAULT and cache == {KEY: DEFAULT}
    assert gemm_tuning.DEFAULTED == {("t", KEY): DEFAULT}
    assert clock == [] and not _user_file().exists()
    with pytest.raises(RuntimeError, match="tune step"):
        gemm_tuning.fastest(KEY, CANDS, clock.append, "t")
    with pytest.raises(RuntimeError, match="tune step"):
        gemm_tuning.remember("t", KEY, "fast")


def test_the_default_is_the_same_in_every_process(clock):
    other = (
        "from libs.kernels import gemm_tuning as g\n"
        "g.device_tag = lambda: 'Test_GPU-triton-9.9'\n"
        "g.graph_time = None\n"
        "print(g.choose({}, (0, 64, 7168, 1536, 1), ['slow', 'fast', 'mid'], print, 't', default='mid'))\n"
    )
    env = {**os.environ, gemm_tuning.CACHE_ENV: str(gemm_tuning.cache_dir())}
    runs = {
        subprocess.run([sys.executable, "-c", other], check=True, env=env, capture_output=True, text=True,
                       cwd=Path(__file__).parents[3]).stdout.strip()
        for _ in range(2)
    }  # fmt: skip
    assert runs == {_pick(clock)} == {DEFAULT}


def test_the_tune_step_writes_the_table_and_a_later_process_reads_it(monkeypatch, clock, tmp_path):
    table_dir = gemm_tuning.cache_dir()
    with gemm_tuning.tuning(table_dir) as path:
        assert gemm_tuning.tuning_active()
        assert _pick(clock) == "fast"
        assert _pick(clock, table="split_k") == "fast"  # another table is its own choice
    assert not gemm_tuning.tuning_active()
    assert clock == CANDS * 2
    assert path == _user_file()
    assert json.loads(path.read_text())["tables"] == {
        "t": {"0,64,7168,1536,1": "fast"},
        "split_k": {"0,64,7168,1536,1": "fast"},
    }
    cache = _new_process(monkeypatch)
    assert _pick(clock, cache=cache) == "fast" and cache == {KEY: "fast"}
    assert clock == CANDS * 2  # read, not timed
    assert gemm_tuning.DEFAULTED == {}


def test_the_tune_step_skips_keys_a_table_answers_unless_retuning(monkeypatch, clock, tmp_path):
    with gemm_tuning.tuning(tmp_path / "a"):
        _pick(clock)
    shipped = tmp_path / "a"
    monkeypatch.setattr(gemm_tuning, "SHIPPED_DIR", shipped)
    with gemm_tuning.tuning(tmp_path / "b") as path:
        assert _pick(clock) == "fast"
    assert clock == CANDS and not path.exists()
    with gemm_tuning.tuning(tmp_path / "b", retune=True) as path:
        assert _pick(clock) == "fast"
    assert clock == CANDS * 2 and path.exists()


def test_a_stored_choice_that_is_no_longer_a_candidate_takes_the_default_or_is_tuned(monkeypatch, clock):
    with gemm_tuning.tuning(gemm_tuning.cache_dir()):
        _pick(clock, cands=["other", *CANDS])
    _new_process(monkeypatch)
    assert _pick(clock) == DEFAULT
    with gemm_tuning.tuning(gemm_tuning.cache_dir()):
        assert _pick(clock) == "fast"
    assert clock == ["other", *CANDS, *CANDS]
    assert json.loads(_user_file().read_text())["tables"]["t"]["0,64,7168,1536,1"] == "fast"


def test_shipped_tables_are_read_and_the_user_table_wins(monkeypatch, tmp_path, clock):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(gemm_tuning, "SHIPPED_DIR", shipped)
    body = {"tables": {"t": {"0,64,7168,1536,1": "slow", "1,8,4096,7168,9": "slow"}}}
    (shipped / "Test_GPU-triton-9.9.json").write_text(json.dumps(body))
    gemm_tuning.cache_dir().mkdir(parents=True)
    _user_file().write_text(json.dumps({"tables": {"t": {"1,8,4096,7168,9": "fast"}}}))
    _new_process(monkeypatch)
    assert _pick(clock) == "slow"
    assert _pick(clock, key=(1, 8, 4096, 7168, 9)) == "fast"
    assert clock == []


def test_writers_merge_their_choices(monkeypatch, clock):
    """Two tune processes writing one table each add their own keys."""
    folder = gemm_tuning.cache_dir()
    with gemm_tuning.tuning(folder):
        _pick(clock)
        other = (
            "from libs.kernels import gemm_tuning as g\n"
            "g.device_tag = lambda: 'Test_GPU-triton-9.9'\n"
            f"with g.tuning({str(folder)!r}):\n"
            "    g.remember('t', (2, 16, 128, 256, 4), 'slow')\n"
            "    g.remember('split_k', ('split', 0, 4, 128, 2048, 1), '2')\n"
        )
        subprocess.run([sys.executable, "-c", other], check=True, cwd=Path(__file__).parents[3])
        _pick(clock, key=(9,))
    tables = json.loads(_user_file().read_text())["tables"]
    assert tables == {
        "t": {"0,64,7168,1536,1": "fast", "2,16,128,256,4": "slow", "9": "fast"},
        "split_k": {"split,0,4,128,2048,1": "2"},
    }


def test_an_empty_user_setting_reads_no_user_table(monkeypatch, tmp_path, clock):
    monkeypatch.setenv(gemm_tuning.CACHE_ENV, "")
    assert gemm_tuning.cache_dir() is None
    assert _pick(clock) == DEFAULT


def test_a_damaged_table_is_ignored_with_a_warning(monkeypatch, clock, caplog):
    gemm_tuning.cache_dir().mkdir(parents=True)
    _user_file().write_text("{not json")
    assert _pick(clock) == DEFAULT
    assert "ignoring tuning table" in caplog.text
    with gemm_tuning.tuning(gemm_tuning.cache_dir()):
        assert _pick(clock) == "fast"
    assert json.loads(_user_file().read_text())["tables"] == {"t": {"0,64,7168,1536,1": "fast"}}


def test_a_key_where_every_candidate_failed_is_not_stored(monkeypatch, clock):
    def fail(c: str) -> None:
        clock.append(c)
        raise RuntimeError("no shared memory")

    with gemm_tuning.tuning(gemm_tuning.cache_dir()):
        assert gemm_tuning.choose({}, KEY, CANDS, fail, "t", default=DEFAULT) == "slow"  # the first
    assert not _user_file().exists()


def test_a_failing_candidate_is_skipped_and_recorded(monkeypatch, clock):
    monkeypatch.setattr(gemm_tuning, "REJECTED", {})
    monkeypatch.setattr(gemm_tuning, "TIMINGS", {})

    def run(c: str) -> None:
        clock.append(c)
        if c == "fast":
            raise RuntimeError("out of shared memory")

    cache: dict = {}
    with gemm_tuning.tuning(gemm_tuning.cache_dir()):
        assert gemm_tuning.choose(cache, KEY, CANDS, run, "t", default=DEFAULT) == "mid"
        assert gemm_tuning.choose(cache, KEY, CANDS, run, "t", default=DEFAULT) == "mid"
    assert clock == CANDS  # timed once
    assert "out of shared memory" in gemm_tuning.REJECTED[(KEY, "fast")]
    assert gemm_tuning.TIMINGS[KEY] == {"slow": 3.0, "fast": float("inf"), "mid": 2.0}


def test_a_nested_sweep_is_counted_once_in_the_time_spent(monkeypatch, clock):
    """The kernel choice times the Triton candidate, whose first launch runs the tile sweep: that sweep's
    seconds belong to the outer one's, not added twice."""
    monkeypatch.setattr(gemm_tuning, "SPENT", {"seconds": 0.0, "timings": 0})
    ticks = iter(range(100))
    monkeypatch.setattr(gemm_tuning.time, "perf_counter", lambda: float(next(ticks)))

    def outer(c: str) -> None:
        clock.append(c)
        gemm_tuning.choose({}, ("inner", c), CANDS, clock.append, "inner", default=DEFAULT)

    with gemm_tuning.tuning(gemm_tuning.cache_dir()):
        gemm_tuning.choose({}, KEY, ["slow", "fast"], outer, "outer", default="slow")
    assert {"seconds": 3.0, "timings": 2 + 2 * len(CANDS)} == gemm_tuning.SPENT  # outer: ticks 0 .. 3
