"""bench.soak's record names the MOEMESH_* settings its services inherited, without their secrets."""

from __future__ import annotations

from bench.soak import shown_setting


def test_inherited_settings_are_shown_with_secrets_masked_and_urls_redacted() -> None:
    assert shown_setting("MOEMESH_MALLOC_TRIM_S", "30") == "30"
    assert shown_setting("MOEMESH_NATS_PASSWORD", "hunter2") == "***"
    assert shown_setting("MOEMESH_DECODE_WORKER_NATS_TOKEN", "t0k") == "***"
    assert shown_setting("MOEMESH_NATS_URL", "nats://u:pw@h:4222") == "nats://u:***@h:4222"
