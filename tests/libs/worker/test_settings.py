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


def test_per_rank_kv_pools_when_asked_or_on_gpus_and_never_in_process() -> None:
    assert not WorkerSettings(model_dir="m", ep_size=2).kv_per_rank  # CPU: one shared pool
    assert WorkerSettings(model_dir="m", ep_size=2, ep_kv_per_rank=True).kv_per_rank
    assert WorkerSettings(model_dir="m", ep_size=2, device="cuda").kv_per_rank  # pools on the ranks' GPUs
    assert not WorkerSettings(model_dir="m", ep_kv_per_rank=True).kv_per_rank  # one rank: one pool
    with pytest.raises(ValueError, match="per-rank KV pools live in the rank processes"):
        WorkerSettings(model_dir="m", ep_size=2, ep_kv_per_rank=True, transfer_protocol="inprocess")
