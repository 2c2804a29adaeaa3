"""The metric arithmetic on recorded timings: known inputs, known answers."""

from __future__ import annotations

import pytest

from libs.loadgen.slowdown import full_batch_window
from libs.loadgen.stats import RequestRecord, aggregate_rate, decode_rate, distribution_ms, summarize


def rec(index: int, start: float, chunks: list[float], *, tokens: list[int] | None = None, end: float | None = None,
        prompt: int = 10, out: int | None = None, ok: bool = True) -> RequestRecord:  # fmt: skip
    toks = tokens or [1] * len(chunks)
    return RequestRecord(
        index=index, start=start, end=chunks[-1] if end is None else end, chunk_times=chunks, chunk_tokens=toks,
        prompt_tokens=prompt, completion_tokens=sum(toks) if out is None else out, ok=ok,
    )  # fmt: skip


def test_per_request_ttft_e2e_tpot_itl() -> None:
    r = rec(0, 1.0, [1.1, 1.2, 1.4, 1.5], end=1.6)
    assert r.ttft == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.1) / 3)  # (E2E - TTFT) / (out - 1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.1])


def test_tpot_uses_the_usage_count_not_the_chunks() -> None:
    # 3 chunks but the server's usage says 5 tokens (a chunk held back bytes and carried two)
    r = rec(0, 0.0, [0.2, 0.4, 1.0], out=5)
    assert r.tpot == pytest.approx((1.0 - 0.2) / 4)
    assert rec(0, 0.0, [0.3], out=1).tpot is None


def test_distribution_percentiles_of_one_to_a_hundred_ms() -> None:
    d = distribution_ms([i / 1000 for i in range(1, 101)])
    assert d["count"] == 100
    assert d["mean"] == pytest.approx(50.5)
    assert d["median"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)  # numpy linear interpolation: 1 + 0.9 * 99
    assert d["p99"] == pytest.approx(99.01)
    assert (d["min"], d["max"]) == pytest.approx((1.0, 100.0))


def test_distribution_of_nothing_is_zeros() -> None:
    assert distribution_ms([]) == {
        "count": 0,
        "mean": 0.0,
        "median": 0.0,
        "p90": 0.0,
        "p99": 0.0,
        "min": 0.0,
        "max": 0.0,
    }


def test_summary_counts_throughput_and_concurrency() -> None:
    records = [
        rec(0, 0.0, [0.5, 1.0, 1.5, 2.0], prompt=100),  # e2e 2.0, 4 tokens
        rec(1, 1.0, [1.2, 1.4, 3.0], prompt=50),  # e2e 2.0, 3 tokens
        RequestRecord(index=2, start=0.5, end=0.6, prompt_tokens=70, error="HTTP 503", ok=False),
    ]
    s = summarize(records, duration_s=4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (
        150,
        7,
    )  # failed requests count for nothing
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["input_throughput"] == pytest.approx(150 / 4)
    assert s["output_throughput"] == pytest.approx(7 / 4)
    assert s["total_token_throughput"] == pytest.approx(157 / 4)
    assert s["concurrency"] == pytest.approx((2.0 + 2.0) / 4.0)
    assert s["ttft_ms"]["mean"] == pytest.approx((500 + 200) / 2)
    assert s["tpot_ms"]["median"] == pytest.approx(((2.0 - 0.5) / 3 + (2.0 - 0.2) / 2) / 2 * 1000)
    assert s["itl_ms"]["count"] == 3 + 2
    assert s["itl_ms"]["max"] == pytest.approx(1600)
    assert s["e2e_ms"]["p99"] == pytest.approx(2000)


def test_summary_rejects_a_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration"):
        summarize([], 0.0)


def test_decode_rate_counts_from_the_first_step_inside_the_window() -> None:
    # 4 requests, one token every 0.1 s; the first step after the release (t=1.0) comes late, at 1.45
    records = [rec(i, 0.0, [0.5, *(1.45 + 0.1 * k for k in range(11))], end=2.5) for i in range(4)]
    w = decode_rate(records, 1.0, 2.45)
    assert (w["requests"], w["tokens"]) == (4, 4 * 10)
    assert w["tokens_per_s"] == pytest.approx(4 * 10.0)  # 40 tokens over 1.45 -> 2.45
    assert w["itl_ms"]["median"] == pytest.approx(100.0)
    assert w["window_s"] == pytest.approx(1.45)


def test_decode_rate_counts_the_tokens_each_chunk_carried_and_requests_that_finish_inside() -> None:
    a = rec(0, 0.0, [1.1, 1.2, 1.3, 1.4, 1.5], tokens=[1, 2, 2, 1, 1])
    b = rec(1, 0.0, [1.1, 1.2], end=1.2)  # finishes inside the window: its one token after the start counts
    assert decode_rate([a, b], 1.0, 1.5)["tokens_per_s"] == pytest.approx((6 + 1) / 0.4)
    assert decode_rate([rec(0, 0.0, [0.5])], 1.0, 2.0)["tokens_per_s"] == 0.0  # nothing inside


def test_full_batch_window_runs_while_nine_tenths_of_the_batch_still_run() -> None:
    # 20 requests running at the release (t=1.0): 2 finish early (they joined long before), the rest at 3.0+
    early = [rec(i, 0.0, [0.5, *(1.1 + 0.1 * k for k in range(3))]) for i in range(2)]
    late = [rec(i, 0.0, [0.5, *(1.1 + 0.1 * k for k in range(20 + i))]) for i in range(2, 20)]
    w = full_batch_window(early + late, release_s=1.0)
    assert (w["batch_from"], w["batch_to"]) == (20, 18)
    assert w["to_s"] == pytest.approx(late[0].end)  # the third finish: 17 would be left after it
    # window (1.0, 3.2]: every request starts at 1.1; the early two make 2 tokens after that, the rest 21
    assert w["tokens_per_s"] == pytest.approx((2 * 2 + 18 * 21) / (3.2 - 1.1))
    assert full_batch_window(early, release_s=5.0)["tokens_per_s"] is None


def test_aggregate_rate_is_tokens_in_the_window_over_its_length() -> None:
    records = [rec(0, 0.0, [0.5, 1.0, 1.5], tokens=[1, 2, 3]), rec(1, 0.0, [0.9, 2.5])]
    assert aggregate_rate(records, 0.5, 1.5) == pytest.approx((2 + 3 + 1) / 1.0)
    assert aggregate_rate(records, 2.0, 2.0) == 0.0
