"""The step-time model: the committed fit, the decode/prefill split, speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.sim.step_time import (
    H200_DECODE,
    H200_DECODE_RECORD,
    DecodeFit,
    StepTimeModel,
    fit_decode,
    load_records,
)

ROOT = Path(__file__).resolve().parents[3]


def test_committed_constants_are_the_fit_of_the_committed_records():
    rows = load_records([ROOT / H200_DECODE_RECORD])
    fit = fit_decode(rows)
    assert fit.fixed_ms == pytest.approx(H200_DECODE.fixed_ms, rel=1e-3)
    assert fit.per_seq_ms == pytest.approx(H200_DECODE.per_seq_ms, rel=1e-3)
    assert fit.per_ctx_token_ms == pytest.approx(H200_DECODE.per_ctx_token_ms, rel=1e-3)
    for r in rows:  # the model reproduces every record within 15%
        assert H200_DECODE.step_ms(r["batch"], r["batch"] * r["ctx"]) == pytest.approx(r["step_ms"], rel=0.15)


def test_fit_recovers_known_coefficients():
    truth = DecodeFit(fixed_ms=4.0, per_seq_ms=0.1, per_ctx_token_ms=2e-5)
    rows = [
        {
            "batch": b,
            "ctx": c,
            "attention_ms": truth.per_ctx_token_ms * b * c,
            "step_ms": truth.step_ms(b, b * c),
        }
        for b, c in ((8, 100), (64, 4000), (256, 2000))
    ]
    fit = fit_decode(rows)
    assert fit.fixed_ms == pytest.approx(4.0) and fit.per_seq_ms == pytest.approx(0.1)
    assert fit.per_ctx_token_ms == pytest.approx(2e-5)
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_decode(rows[:1])


def test_forward_is_decode_when_every_chunk_brings_one_token():
    tm = StepTimeModel(prefill_fixed_ms=5.0, prefill_per_token_ms=0.04)
    assert tm.forward_ms([1] * 256, [2048] * 256) == pytest.approx(H200_DECODE.step_ms(256, 256 * 2048))
    assert tm.forward_ms([2000], [2000]) == pytest.approx(5.0 + 80.0)
    assert tm.forward_ms([1, 7], [10, 20]) == pytest.approx(5.0 + 0.04 * 8)
    assert tm.forward_ms([], []) == 0.0
    fast = StepTimeModel(speed=4.0)
    assert fast.forward_ms([1] * 64, [100] * 64) == pytest.approx(tm.forward_ms([1] * 64, [100] * 64) / 4)
    assert H200_DECODE.step_ms(256, 256 * 2048) > H200_DECODE.step_ms(64, 64 * 2048)
    with pytest.raises(ValueError):
        StepTimeModel(speed=0)
