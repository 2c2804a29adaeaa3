"""`moemesh up`'s options and worker flags through their layers (flag > env > config file > default), and
its readiness wait: long enough on a GPU for the workers' warm-up, as given otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.bus.settings import LAUNCHER_KEYS, SettingsError
from libs.cli.main import build_parser
from libs.cli.up import _Default, mesh_config, ready_timeout, resolve_options, worker_env


def parse(*argv: str):
    return build_parser().parse_args(["up", *argv])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")  # up checks only that it is a checkpoint folder
    return tmp_path / "ckpt"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "moemesh.yaml"
    path.write_text(text)
    return str(path)


def test_ready_timeout_defaults_by_device_and_keeps_what_is_given() -> None:
    assert ready_timeout(None, "cpu") == 120.0
    assert ready_timeout(None, "cuda") == ready_timeout(None, "cuda:1") == 900.0
    assert ready_timeout(30.0, "cuda") == 30.0


def test_help_lists_the_config_file_and_the_engine_flags_with_vllm_names(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for flag in (
        "--config", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--num-gpu-blocks-override",
        "--no-enable-prefix-caching", "--attention-backend", "--quantization", "--num-speculative-tokens",
        "--device", "--dtype", "--ep-size", "--dp-size", "--transfer-protocol", "--mtp-k",
    ):  # fmt: skip
        assert flag in out, flag


def test_up_options_a_file_may_set_are_the_launcher_keys() -> None:
    args = parse()
    assert {k for k, v in vars(args).items() if isinstance(v, _Default)} == set(LAUNCHER_KEYS)


def test_up_options_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    cfg = write(tmp_path, "decode_workers: 3\nprefill_workers: 0\nnats_user: file\nport: '9000'\n")
    env = {"MOEMESH_NATS_USER": "env"}
    args = parse("--config", cfg, "--decode-workers", "2")
    top = resolve_options(args, env)
    assert (args.decode_workers, args.prefill_workers, args.nats_user, args.port) == (2, 0, "env", 9000)
    assert (args.schedulers, args.host) == (1, "127.0.0.1")  # defaults where nothing is set
    assert top["decode_workers"] == 3
    args = parse("--config", cfg, "--nats-user", "flag")
    resolve_options(args, env)
    assert args.nats_user == "flag"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("decode_worker: 2\n", "unknown key 'decode_worker' in config file"),
        ("decode_workers: two\n", "decode_workers must be of type int, got 'two'"),
        ("decode_workers: [1]\n", "decode_workers must be of type int"),
    ],
)
def test_bad_launcher_keys_in_the_file_are_errors(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_options(parse("--config", write(tmp_path, text)), {})


def test_worker_flags_become_env_overrides_only_when_given() -> None:
    assert worker_env(parse()) == {}  # env and the file stay the workers' to read
    args = parse("--max-num-seqs", "5", "--block-size", "32", "--no-enable-prefix-caching", "--mtp-k", "2")
    env = worker_env(args)
    assert env["services.decode_worker"] == {
        "MOEMESH_DECODE_WORKER_MAX_NUM_SEQS": "5", "MOEMESH_DECODE_WORKER_PAGE_SIZE": "32",
        "MOEMESH_DECODE_WORKER_ENABLE_PREFIX_CACHE": "false", "MOEMESH_DECODE_WORKER_MTP_K": "2",
    }  # fmt: skip
    assert "MOEMESH_PREFILL_WORKER_MTP_K" not in env["services.prefill_worker"]  # drafts: decode only
    assert env["services.prefill_worker"]["MOEMESH_PREFILL_WORKER_MAX_NUM_SEQS"] == "5"
    assert worker_env(parse("--num-speculative-tokens", "3"))["services.decode_worker"] == {
        "MOEMESH_DECODE_WORKER_MTP_K": "3"
    }


def test_mesh_config_passes_the_file_on_and_sees_the_workers_layers(tmp_path: Path, model: Path) -> None:
    cfg_file = write(tmp_path, "device: cuda\nmax_num_seqs: 8\ndecode-worker:\n  max_prefill_tokens: 512\n")
    env = {"MOEMESH_DECODE_WORKER_MAX_PREFILL_TOKENS": "256"}
    cfg, worker = mesh_config(parse("--model", str(model), "--config", cfg_file, "--max-num-seqs", "5"), env)
    assert cfg.config_file == Path(cfg_file).resolve()
    assert cfg.device is None and cfg.extra_env["services.decode_worker"] == {
        "MOEMESH_DECODE_WORKER_MAX_NUM_SEQS": "5"
    }
    assert (worker.device, worker.max_num_seqs, worker.max_prefill_tokens) == ("cuda", 5, 256)
    _, worker = mesh_config(parse("--model", str(model), "--config", cfg_file, "--device", "cpu"), {})
    assert (worker.device, worker.max_num_seqs, worker.max_prefill_tokens) == ("cpu", 8, 512)


def test_existing_worker_flags_keep_working_and_are_checked(model: Path) -> None:
    argv = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--transfer-protocol", "rdma"]
    _, worker = mesh_config(parse(*argv, "--ep-size", "2", "--dp-size", "2", "--mtp-k", "1"), {})
    assert (worker.dtype, worker.transfer_protocol, worker.ep_size, worker.dp_size, worker.mtp_k) == (
        "float32", "rdma", 2, 2, 1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="dp_size must equal ep_size"):
        mesh_config(parse("--model", str(model), "--ep-size", "2", "--dp-size", "1"), {})
    with pytest.raises(ValueError, match="mtp_k"):
        mesh_config(parse("--model", str(model), "--mtp-k", "9"), {})
    with pytest.raises(SettingsError, match="nope.yaml"):
        mesh_config(parse("--model", str(model), "--config", str(model / "nope.yaml")), {})


def test_mixed_kv_cache_dtypes_between_worker_kinds_refuse_to_start(tmp_path: Path, model: Path) -> None:
    """A prefill-worker section (or env var) that gives prefill workers another kv_cache_dtype than the decode
    workers stops `up` before anything starts; one setting for both (flag, top level) is fine."""
    mixed = write(tmp_path, "prefill-worker:\n  kv_cache_dtype: fp8_e4m3\n")
    with pytest.raises(ValueError, match="prefill workers would run kv_cache_dtype fp8_e4m3 and decode workers"):
        mesh_config(parse("--model", str(model), "--config", mixed), {})
    with pytest.raises(ValueError, match="kv_cache_dtype auto and decode workers fp8_e4m3"):
        mesh_config(parse("--model", str(model)), {"MOEMESH_DECODE_WORKER_KV_CACHE_DTYPE": "fp8_e4m3"})
    cfg, worker = mesh_config(parse("--model", str(model), "--kv-cache-dtype", "fp8_e4m3"), {})
    assert worker.kv_cache_dtype == "fp8_e4m3"
    assert cfg.extra_env["services.prefill_worker"]["MOEMESH_PREFILL_WORKER_KV_CACHE_DTYPE"] == "fp8_e4m3"
    both = write(tmp_path, "kv_cache_dtype: fp8_e4m3\n")
    assert mesh_config(parse("--model", str(model), "--config", both), {})[1].kv_cache_dtype == "fp8_e4m3"
    mixed = write(tmp_path, "prefill-worker:\n  kv_cache_dtype: fp8_e4m3\n")
    _, worker = mesh_config(parse("--model", str(model), "--config", mixed, "--prefill-workers", "0"), {})
    assert worker.kv_cache_dtype == "auto"  # no prefill workers: no pages change hands


def test_mixed_attention_backends_over_an_fp8_cache_refuse_to_start(tmp_path: Path, model: Path) -> None:
    """FP8 rows are laid out for the backend's decode kernel ("tensor" for FlashInfer, "token" for Triton), so
    with kv_cache_dtype fp8_e4m3 prefill and decode workers must name the same attention backend; over the
    plain cache they need not."""
    mixed = write(tmp_path, "kv_cache_dtype: fp8_e4m3\nprefill-worker:\n  attention_backend: triton\n")
    with pytest.raises(ValueError, match="attention_backend triton and decode workers auto over an FP8 KV cache"):
        mesh_config(parse("--model", str(model), "--config", mixed), {})
    plain = write(tmp_path, "prefill-worker:\n  attention_backend: triton\n")
    assert mesh_config(parse("--model", str(model), "--config", plain), {})[1].attention_backend == "auto"


def test_kv_store_without_mooncake_store_refuses_to_start(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mooncake wheel without the store (one pruned to its transfer engine) stops `up --kv-store` before
    anything starts."""
    import importlib.util

    argv = ("--model", str(model), "--kv-store", "--host-kv-pages", "64")
    assert mesh_config(parse(*argv), {})[0].kv_store  # this machine's wheel has the store
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("mooncake.") else real(name, *a))
    with pytest.raises(ValueError, match=r"--kv-store needs Mooncake Store: .*neither of mooncake\.store, mooncake\._store"):
        mesh_config(parse(*argv), {})
