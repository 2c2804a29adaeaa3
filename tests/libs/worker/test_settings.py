"""WorkerSettings validation."""

from __future__ import annotations

import pytest

from libs.worker.settings import WorkerSettings


def test_worker_settings_validate_quantization() -> None:
    assert WorkerSettings(model_dir="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be auto, fp8 or none"):
        WorkerSettings(model_dir="m", quantization="int4")
    # EP ranks keep FP8 experts too (libs/ep/loader.py)
    assert WorkerSettings(model_dir="m", quantization="fp8", ep_size=2, dp_size=2).quantization == "fp8"


def test_worker_settings_ep_backend() -> None:
    assert WorkerSettings(model_dir="m").ep_backend == "auto"  # fixed on CUDA, all-to-all on CPU
    assert WorkerSettings(model_dir="m", ep_backend="fixed").ep_backend == "fixed"
    with pytest.raises(ValueError, match="ep_backend must be auto, fixed, torch"):
        WorkerSettings(model_dir="m", ep_backend="nccl")
