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
