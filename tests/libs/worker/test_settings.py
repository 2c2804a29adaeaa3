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


def test_dtype_auto_is_16_bit_on_cuda_and_float32_on_the_cpu() -> None:
    assert WorkerSettings(model_dir="m").activation_dtype == "float32"
    assert WorkerSettings(model_dir="m", device="cuda").activation_dtype == "bfloat16"
    assert WorkerSettings(model_dir="m", device="cuda:1", dtype="float32").activation_dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be auto"):
        WorkerSettings(model_dir="m", dtype="bf16")


def test_prefill_worker_attention_auto_resolves_per_device() -> None:
    from services.prefill_worker.service import PrefillWorkerSettings

    assert PrefillWorkerSettings(model_dir="m").engine_attention_backend == "triton"  # CPU: SDPA per sequence
    assert PrefillWorkerSettings(model_dir="m", device="cuda").engine_attention_backend == "auto"
    assert WorkerSettings(model_dir="m").engine_attention_backend == "auto"


def test_per_rank_kv_pools_when_asked_or_on_gpus_and_never_in_process() -> None:
    assert not WorkerSettings(model_dir="m", ep_size=2).kv_per_rank  # CPU: one shared pool
    assert WorkerSettings(model_dir="m", ep_size=2, ep_kv_per_rank=True).kv_per_rank
    assert WorkerSettings(model_dir="m", ep_size=2, device="cuda").kv_per_rank  # pools on the ranks' GPUs
    assert not WorkerSettings(model_dir="m", ep_kv_per_rank=True).kv_per_rank  # one rank: one pool
    with pytest.raises(ValueError, match="per-rank KV pools live in the rank processes"):
        WorkerSettings(model_dir="m", ep_size=2, ep_kv_per_rank=True, transfer_protocol="inprocess")


def test_worker_settings_ep_backend() -> None:
    assert WorkerSettings(model_dir="m").ep_backend == "auto"  # fixed on CUDA, all-to-all on CPU
    assert WorkerSettings(model_dir="m", ep_backend="fixed").ep_backend == "fixed"
    with pytest.raises(ValueError, match="ep_backend must be auto, fixed, torch"):
        WorkerSettings(model_dir="m", ep_backend="nccl")


def test_worker_settings_take_two_batch_overlap_where_it_runs() -> None:
    assert WorkerSettings(model_dir="m", two_batch_overlap=True, ep_size=2, dp_size=2).two_batch_overlap
    fi = WorkerSettings(model_dir="m", two_batch_overlap=True, attention_backend="flashinfer")
    assert fi.two_batch_overlap and fi.attention_backend == "flashinfer"
    for bad in (dict(mtp_k=2), dict(engine="sim")):
        with pytest.raises(ValueError, match="two_batch_overlap"):
            WorkerSettings(model_dir="m", two_batch_overlap=True, **bad)  # type: ignore[arg-type]


def test_workers_keep_one_malloc_arena_on_the_cpu_and_trim_it_every_30_s() -> None:
    from libs.bus.settings import load_settings
    from services.decode_worker.service import DecodeWorkerSettings
    from services.scheduler.service import SchedulerSettings

    assert WorkerSettings(model_dir="m").arena_max() == 1
    assert WorkerSettings(model_dir="m", device="cuda").arena_max() == 0  # glibc's default
    assert WorkerSettings(model_dir="m", malloc_arena_max=0).arena_max() == 0
    assert WorkerSettings(model_dir="m", device="cuda", malloc_arena_max=2).arena_max() == 2
    assert WorkerSettings(model_dir="m").malloc_trim_s == 30.0
    assert SchedulerSettings().arena_max() == 0 and SchedulerSettings().malloc_trim_s == 0.0
    # MOEMESH_MALLOC_TRIM_S / _ARENA_MAX reach every service; a service's own variable wins
    env = {"MOEMESH_MALLOC_TRIM_S": "5", "MOEMESH_MALLOC_ARENA_MAX": "2", "MOEMESH_DECODE_WORKER_MODEL_DIR": "m"}
    assert load_settings(SchedulerSettings, "scheduler", env=env).malloc_trim_s == 5.0
    decode = load_settings(DecodeWorkerSettings, "decode-worker", env=env | {"MOEMESH_DECODE_WORKER_MALLOC_TRIM_S": "0"})
    assert decode.malloc_trim_s == 0.0 and decode.arena_max() == 2
