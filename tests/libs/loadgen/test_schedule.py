"""The Poisson arrival schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from libs.loadgen.schedule import arrival_times


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_poisson_arrivals_are_seeded_ordered_and_have_the_asked_mean_gap() -> None:
    a = arrival_times(20_000, request_rate=4.0, seed=3)
    assert a == arrival_times(20_000, request_rate=4.0, seed=3)
    assert a != arrival_times(20_000, request_rate=4.0, seed=4)
    assert a[0] == 0.0 and len(a) == 20_000
    gaps = np.diff(a)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std equals the mean


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_a_rate_that_is_not_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, rate)


def test_no_requests_no_arrivals() -> None:
    assert arrival_times(0, 2.0) == []
