"""The soak's flatness judgements: a leak within process lifetimes is caught though restarts reset it;
a flat noisy series and a spike in the middle are not called leaks; a purged sawtooth is judged by what
each purge leaves, so a steady one is flat and one whose troughs rise, or whose purges stop, is not."""

from __future__ import annotations

import random

from libs.chaos.drift import judge_purged, judge_slope, judge_thirds, pooled_slope, purge_troughs, thirds


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


# the soak's record: the bucket empty 30 s before its t=0 (338 messages then), the broker's purge clock
# from -62 s, and from its restart at 902 s
PURGES = (238, 538, 838, 902, 1202, 1502, 1802, 2102)


def handle_bucket(
    seconds: int, leak_every: int = 0, purges: tuple[int, ...] = PURGES
) -> list[tuple[float, float]]:
    """The kv-broker's handle bucket as the soak samples it (every 10 s from t=0): ~228 live keys, 3.85
    deletes/s each leaving a marker, markers older than 600 s purged at `purges`; every `leak_every`-th
    marker is never purged."""
    rng = random.Random(1)
    markers: list[tuple[float, bool]] = []  # (created, never purged)
    made, out = 0, []
    for t in range(-30, seconds + 1):
        for _ in range(4 if rng.random() < 0.85 else 3):  # 3.85/s
            made += 1
            markers.append((float(t), leak_every > 0 and made % leak_every == 0))
        if t in purges:
            markers = [(c, keep) for c, keep in markers if keep or t - c < 600]
        if t >= 0 and t % 10 == 0:
            out.append((float(t), 228.0 + rng.randint(-6, 6) + len(markers)))
    return out


def test_a_steady_purged_sawtooth_is_flat_though_its_thirds_differ() -> None:
    s = [p for p in handle_bucket(1800) if p[0] >= 300]  # the soak's 5 warm-up minutes left out
    assert [round(t) for t, _ in purge_troughs(s)] == [840, 910, 1210, 1510]
    # the bucket filling up to its first purge reads as growth (the soak's record: 2.42k -> 3.15k)
    assert not judge_thirds("msgs", s, 0.25, 16).flat
    j = judge_purged("msgs", s, period_s=300, rel_tol=0.15, abs_tol=16)
    assert j.flat, j.why
    assert "after 4 purges" in j.why


def test_a_purged_sawtooth_with_rising_troughs_is_not_flat() -> None:
    s = [p for p in handle_bucket(1800, leak_every=5) if p[0] >= 300]  # a fifth of the markers stay
    troughs = [v for _, v in purge_troughs(s)]
    assert len(troughs) == 4 and troughs == sorted(troughs) and troughs[-1] - troughs[0] > 400
    j = judge_purged("msgs", s, period_s=300, rel_tol=0.15, abs_tol=16)
    assert not j.flat, j.why


def test_purges_that_stop_are_not_flat() -> None:
    s = [p for p in handle_bucket(2100, purges=PURGES[:4]) if p[0] >= 300]  # none after 902 s
    assert len(purge_troughs(s)) == 2  # troughs equal: only the 1,190 s without a purge tell
    j = judge_purged("msgs", s, period_s=300, rel_tol=0.15, abs_tol=16)
    assert not j.flat and "without a purge" in j.why, j.why


def test_without_two_purges_it_is_judged_by_thirds() -> None:
    growing = [(float(t), 300.0 + 3.85 * t) for t in range(0, 600, 10)]
    j = judge_purged("msgs", growing, period_s=300, rel_tol=0.15, abs_tol=16)
    assert not j.flat and "0 purge(s) seen" in j.why
    steady = [(float(t), 2.0) for t in range(0, 600, 10)]  # the workers bucket: no deletes, no purges
    assert judge_purged("msgs", steady, period_s=300, rel_tol=0.15, abs_tol=16).flat
