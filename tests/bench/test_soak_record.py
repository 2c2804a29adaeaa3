"""bench.soak's record names the MOEMESH_* settings its services inherited, without their secrets."""

from __future__ import annotations

from bench.soak import shown_setting


def test_inherited_settings_are_shown_with_secrets_masked_and_urls_redacted() -> None:
    assert shown_setting("MOEMESH_MALLOC_TRIM_S", "30") == "30"
    assert shown_setting("MOEMESH_NATS_PASSWORD", "hunter2") == "***"
    assert shown_setting("MOEMESH_DECODE_WORKER_NATS_TOKEN", "t0k") == "***"
    assert shown_setting("MOEMESH_NATS_URL", "nats://u:pw@h:4222") == "nats://u:***@h:4222"


def _samples(rss_of, until=1800):
    """Samples every 10 s of services "a" and "b" (b killed, so restarted, at 600 s)."""
    return [
        {"t": float(t), "rss_mib": {"a": rss_of(t), "b": 100.0}, "restarts": {"a": 0, "b": int(t >= 600)}}
        for t in range(0, until, 10)
    ]


KILLS = [{"t": 600.0, "killed": "b"}, {"t": 1200.0, "killed": "c"}]


def test_kills_cut_rss_into_stretches_and_their_steps_are_reported() -> None:
    """A service whose RSS steps up by 30 MiB at another's kill and is flat otherwise: the steps are found
    (the killed service's own restart is not a step), the slope between kills is flat; one that grows
    steadily grows between kills too."""
    from bench.soak import rss_steps, rss_stretches
    from libs.chaos.drift import pooled_slope

    stepped = _samples(lambda t: 500.0 + 30 * (t >= 610) + 30 * (t >= 1210))
    stretches = rss_stretches(stepped, KILLS, "a", warmup_s=300.0)
    assert [(s[0][0], s[-1][0]) for s in stretches] == [(300.0, 590.0), (720.0, 1190.0), (1320.0, 1790.0)]
    assert pooled_slope(stretches) == 0.0
    steps = rss_steps(stepped, KILLS, warmup_s=300.0)
    assert [(x["service"], x["at_kill_of"], x["step_mib"]) for x in steps if x["step_mib"]] == [
        ("a", "b", 30.0), ("a", "c", 30.0)
    ]
    leak = _samples(lambda t: 500.0 + t / 60)  # 60 MiB/h
    assert round(pooled_slope(rss_stretches(leak, KILLS, "a", 300.0)) * 3600) == 60


def test_a_record_is_judged_from_what_it_measured() -> None:
    """judge_record (also `--rejudge`): the lifetime slopes judge, the steps and between-kill slopes explain."""
    from bench.soak import judge_record

    record = {
        "samples": [dict(s, workers={}, handles={}, jetstream={}) for s in _samples(lambda t: 500.0 + 30 * (t >= 610))],
        "faults": KILLS, "per_minute": [], "outcomes": {"error": 0, "hung": 0, "wrong": 0},
        "after_load": {"left_on_workers": {"decode-0": 0}, "live_handles": 0},
    }  # fmt: skip
    v = judge_record(record, warmup_s=300.0)
    rss_a = next(j for j in v["judgements"] if j["series"] == "rss_mib[a]")
    assert not rss_a["flat"] and not v["flat"]  # a 30 MiB step in 25 minutes reads as growth
    assert v["rss_mib_per_h_between_kills"]["a"] == 0.0 and v["rss_steps_at_kills"][0]["step_mib"] == 30.0
    record["after_load"]["live_handles"] = 1
    assert not judge_record(record, warmup_s=300.0)["nothing_left_after_load"]
