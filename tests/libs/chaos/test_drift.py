"""The soak's flatness judgements: a leak within process lifetimes is caught though restarts reset it;
a flat noisy series and a spike in the middle are not called leaks."""

from __future__ import annotations

import random

from libs.chaos.drift import judge_slope, judge_thirds, pooled_slope, thirds


def test_pooled_slope_sees_growth_inside_lifetimes_that_restarts_hide() -> None:
    # two lifetimes, each growing 1 unit/s from its own start; overall the series falls (a restart)
    a = [(t, 100.0 + t) for t in range(0, 10)]
    b = [(t, 20.0 + (t - 10)) for t in range(10, 20)]
    assert pooled_slope([a, b]) == 1.0
    assert pooled_slope([a + b]) is not None and pooled_slope([a + b]) < 0  # one fit across would miss it
    assert pooled_slope([[(0.0, 1.0)], []]) is None


def test_slope_judgement_against_its_tolerance_per_hour() -> None:
    rng = random.Random(0)
    flat = [[(float(t), 500.0 + rng.uniform(-5, 5)) for t in range(0, 1800, 10)]]
    leak = [[(float(t), 500.0 + t / 60) for t in range(0, 1800, 10)]]  # 60 per hour
    assert judge_slope("rss", flat, per_hour_tol=32).flat
    j = judge_slope("rss", leak, per_hour_tol=32)
    assert not j.flat and "+60/h" in j.why
    assert not judge_slope("rss", [[(0.0, 1.0)]], 32).flat


def test_thirds_ignore_a_spike_in_the_middle_but_not_a_rising_floor() -> None:
    spike = [(float(t), 10.0 if 40 <= t < 60 else 2.0) for t in range(100)]
    assert thirds(spike) == (2.0, 2.0)
    assert judge_thirds("pages", spike, rel_tol=0.25, abs_tol=1).flat
    rising = [(float(t), t / 10) for t in range(100)]
    assert not judge_thirds("pages", rising, rel_tol=0.25, abs_tol=1).flat
    assert not judge_thirds("pages", rising[:2], 0.25, 1).flat
