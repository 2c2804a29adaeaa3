"""WorkerSettings validation."""

from __future__ import annotations

import pytest

from libs.worker.settings import WorkerSettings


def test_worker_settings_validate_quantization() -> None:
    assert WorkerSettings(model_dir="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be auto, fp8 or none"):
        WorkerSettings(model_dir="m", quantization="int4")
    with pytest.raises(ValueError, match="EP ranks load dequantized experts"):
        WorkerSettings(model_dir="m", quantization="fp8", ep_size=2, dp_size=2)


def test_worker_settings_take_two_batch_overlap_where_it_runs() -> None:
    assert WorkerSettings(model_dir="m", two_batch_overlap=True, ep_size=2, dp_size=2).two_batch_overlap
    for bad in (dict(mtp_k=2), dict(engine="sim"), dict(attention_backend="flashinfer")):
        with pytest.raises(ValueError, match="two_batch_overlap"):
            WorkerSettings(model_dir="m", two_batch_overlap=True, **bad)  # type: ignore[arg-type]
