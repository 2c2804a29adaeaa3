"""The decode worker's step timeline: rows on disk in batches, and the full-batch analysis after a release."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.worker.step_trace import FIELDS, StepTrace, full_batch, load, series


def _row(
    t: float, outputs: int, sleep_ms: float = 0.0, engine_ms: float = 4.0, gc_ms: float = 0.0
) -> tuple[float, ...]:
    """A step submitted at t: 0.5 ms to the engine thread, engine_ms there (3 of them blocked on the device,
    gc_ms in garbage collection), 0.25 ms back, 1 ms publishing."""
    e_in = t + 0.0005
    e_out = e_in + engine_ms / 1000
    return (t, e_in, e_out, e_out + 0.00025, e_out + 0.00125, outputs, outputs, sleep_ms, 0.003, gc_ms / 1000)


def test_rows_reach_the_file_in_batches_and_on_flush(tmp_path: Path) -> None:
    trace = StepTrace.for_worker(tmp_path / "steps.jsonl", "decode-7")
    assert trace.path == tmp_path / "steps-decode-7.jsonl"
    trace.every = 3
    for k in range(4):
        trace.add(*_row(k, 2))
    assert [r["submitted"] for r in load(trace.path)] == [0, 1, 2]  # the fourth waits for the next batch
    trace.flush()
    rows = load(trace.path)
    assert len(rows) == 4 and set(rows[0]) == set(FIELDS) and rows[3]["outputs"] == 2
    with pytest.raises(ValueError, match="fields"):
        trace.add(1.0, 2.0)


def test_full_batch_takes_the_longest_full_run_after_the_last_sleep() -> None:
    rows = [dict(zip(FIELDS, r, strict=True)) for r in (
        [_row(k * 0.01, 10) for k in range(20)]  # full, but before the release: left out
        + [_row(0.3 + k * 0.1, 6, sleep_ms=100) for k in range(3)]  # the hold
        + [_row(1.0 + k * 0.01, 10, gc_ms=2.0 * (k == 3)) for k in range(5)]  # released, full: 10 ms apart
        + [_row(1.05, 7)]  # a short batch breaks the run
        + [_row(1.06 + k * 0.01, 10) for k in range(2)]  # a shorter full run
    )]  # fmt: skip
    got = full_batch(rows, min_outputs=9)
    assert got["steps"] == 5
    assert got["tokens_per_s"] == pytest.approx(4 * 10 / 0.04)  # all but the first step's tokens over 40 ms
    assert got["step_interval_ms"]["median"] == pytest.approx(10)
    assert got["engine_step_ms"]["median"] == pytest.approx(4)
    assert got["device_wait_ms"]["median"] == pytest.approx(3)
    assert got["to_engine_ms"]["median"] == pytest.approx(0.5)
    assert got["to_loop_ms"]["median"] == pytest.approx(0.25)
    assert got["publish_ms"]["median"] == pytest.approx(1)
    assert got["engine_idle_ms"]["median"] == pytest.approx(6)  # 10 ms apart, 4 ms busy
    assert got["gc_ms"]["max"] == pytest.approx(2) and got["gc_ms"]["median"] == 0
    assert full_batch(rows, min_outputs=11) == {"steps": 0, "tokens_per_s": None}


def test_series_lists_each_step_after_the_release() -> None:
    rows = [dict(zip(FIELDS, r, strict=True)) for r in (
        [_row(0.1 * k, 6, sleep_ms=100) for k in range(2)]  # the hold: left out
        + [_row(1.0 + k * 0.01, 10) for k in range(3)]
    )]  # fmt: skip
    rows[-1]["device_wait"] = -1.0  # an engine that does not say
    rows[-2]["gc"] = 0.25  # a collection of a quarter second inside that step
    del rows[-1]["gc"]  # a trace from before the column
    got = series(rows)
    assert got["outputs"] == [10, 10, 10]
    assert got["interval_ms"] == [10.0, 10.0] and got["engine_ms"] == [4.0, 4.0, 4.0]
    assert got["device_wait_ms"] == [3.0, 3.0, None]
    assert got["idle_ms"] == [6.0, 6.0]
    assert got["gc_ms"] == [0.0, 250.0, 0.0]
