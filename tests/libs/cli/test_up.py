"""`moemesh up`'s readiness wait: long enough on a GPU for the workers' warm-up, as given otherwise."""

from __future__ import annotations

from libs.cli.up import ready_timeout


def test_ready_timeout_defaults_by_device_and_keeps_what_is_given() -> None:
    assert ready_timeout(None, "cpu") == 120.0
    assert ready_timeout(None, "cuda") == ready_timeout(None, "cuda:1") == 900.0
    assert ready_timeout(30.0, "cuda") == 30.0
