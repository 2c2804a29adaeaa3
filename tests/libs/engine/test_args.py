"""EngineArgs: defaults written once (the worker settings read them), values validated, keyword overrides, and
the typed arguments an EP rank receives."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from libs.engine.args import DEFAULTS, EngineArgs, with_overrides
from libs.ep.rank import RankSpec
from libs.worker.settings import WorkerSettings
from libs.worker.startup import engine_args


def test_defaults() -> None:
    a = EngineArgs()
    assert (a.page_size, a.num_pages, a.max_num_seqs, a.max_prefill_tokens) == (16, 0, 64, 2048)
    assert a.enable_prefix_cache and a.cuda_graphs and a.overlap and a.fast_path is None
    assert (a.ep_size, a.mtp_k, a.ep_kv_transfer) == (1, 0, None)
    assert a.resolved_dtype == "float32"
    assert EngineArgs(device="cuda:1").resolved_dtype == "bfloat16"
    assert EngineArgs(device="cuda", dtype="float16").resolved_dtype == "float16"


def test_worker_settings_defaults_are_engine_args_defaults() -> None:
    """Every settings field that is also an engine argument has its default, and engine_args maps the
    default settings onto the default arguments."""
    defaults = WorkerSettings(model_dir="m")
    shared = set(WorkerSettings.__struct_fields__) & set(EngineArgs.__struct_fields__)
    assert {"page_size", "max_num_seqs", "max_prefill_tokens", "num_pages", "mtp_k", "ep_size"} <= shared
    for name in shared:
        assert getattr(defaults, name) == getattr(DEFAULTS, name), name
    assert engine_args(defaults) == DEFAULTS


def test_engine_args_from_settings() -> None:
    s = WorkerSettings(
        model_dir="m", page_size=4, num_pages=100, max_num_seqs=8, device="cuda", ep_size=2,
        attention_backend="triton", ep_backend="fixed", eplb_interval_steps=50, transfer_protocol="rdma",
    )  # fmt: skip
    a = engine_args(s)
    assert (a.page_size, a.num_pages, a.max_num_seqs, a.ep_size, a.ep_backend) == (4, 100, 8, 2, "fixed")
    assert a.eplb_interval_steps == 50 and a.resolved_dtype == "bfloat16"
    assert a.attention_backend == "auto"  # EP ranks run the auto backend
    assert a.ep_kv_transfer == ("rdma", "127.0.0.1", "")  # per-rank pools: forced by GPU ranks
    assert (
        engine_args(WorkerSettings(model_dir="m", attention_backend="triton")).attention_backend == "triton"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"page_size": 0}, "page_size must be an integer >= 1"),
        ({"num_pages": -1}, "num_pages must be an integer >= 0"),
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
        ({"max_prefill_tokens": True}, "max_prefill_tokens must be an integer"),
        ({"dtype": "bf16"}, "dtype must be one of auto, float32, bfloat16, float16"),
        ({"quantization": "int4"}, "quantization must be one of"),
        ({"attention_backend": "sdpa"}, "attention_backend must be one of"),
        ({"ep_backend": "nvshmem"}, "ep_backend must be one of"),
        ({"device": "mps"}, "device must be cpu, cuda or cuda:N"),
        ({"enable_prefix_cache": 1}, "enable_prefix_cache must be true or false"),
        ({"ep_timeout_s": 0}, "ep_timeout_s must be a number > 0"),
        ({"ep_kv_transfer": ("tcp", "h")}, "ep_kv_transfer must be"),
        ({"two_batch_overlap": True, "mtp_k": 2}, "two_batch_overlap does not run with MTP"),
    ],
)
def test_bad_values_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**change)
    with pytest.raises(ValueError, match=message):  # the override path validates too
        with_overrides(None, change)


def test_overrides() -> None:
    base = EngineArgs(page_size=4, max_num_seqs=8)
    assert with_overrides(None, {}) is DEFAULTS and with_overrides(base, {}) is base
    got = with_overrides(base, {"max_num_seqs": 2, "enable_prefix_cache": False})
    assert (got.page_size, got.max_num_seqs, got.enable_prefix_cache) == (4, 2, False)
    assert base.max_num_seqs == 8  # frozen: the base is untouched
    with pytest.raises(TypeError, match="unknown engine argument.*max_batch"):
        with_overrides(base, {"max_batch": 4})


def test_an_ep_rank_receives_typed_args(tmp_path: Path) -> None:
    args = EngineArgs(
        num_pages=48, max_num_seqs=8, ep_size=2, ep_backend="fixed", ep_kv_transfer=("tcp", "h", "")
    )
    spec = RankSpec(
        model_dir=str(tmp_path), init_method="file:///x", placement=([[0, 1], [2, 3]], 4, 2), engine=args
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=RankSpec)
    assert back == spec and isinstance(back.engine, EngineArgs) and back.ep_size == 2
    assert back.engine.ep_kv_transfer == ("tcp", "h", "")
    bad = msgspec.msgpack.encode({**msgspec.structs.asdict(spec), "engine": {"max_num_seqs": 0}})
    with pytest.raises(msgspec.ValidationError, match="max_num_seqs must be an integer >= 1"):
        msgspec.msgpack.decode(bad, type=RankSpec)
