"""A worker whose setup fails (such as Mooncake unable to register its pool; simulated by a model folder that
does not load) stops with its setup error and drains without a second error: on_drain must not assume the
heartbeat that setup never started."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from services.decode_worker.service import DecodeWorker, DecodeWorkerSettings
from services.prefill_worker.service import PrefillWorker, PrefillWorkerSettings


@pytest.mark.parametrize("kind", ["decode", "prefill"])
async def test_a_worker_whose_setup_failed_drains_cleanly(
    kind: str, private_nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-such-model"
    cls, settings_cls = (
        (DecodeWorker, DecodeWorkerSettings) if kind == "decode" else (PrefillWorker, PrefillWorkerSettings)
    )
    settings = settings_cls(
        nats_url=private_nats_url, instance_id=f"{kind}-{uuid.uuid4().hex[:8]}", model_dir=str(missing),
        transfer_protocol="inprocess",
    )  # fmt: skip
    worker = cls(settings)
    with caplog.at_level(logging.ERROR, logger="moemesh.service"), pytest.raises(Exception) as info:
        await worker.run(install_signals=False)
    assert str(missing) in str(info.value) or "no-such-model" in str(info.value)  # the setup's own error
    assert not [r for r in caplog.records if "on_drain failed" in r.getMessage()]
