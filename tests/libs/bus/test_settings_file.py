"""The config-file layer and alias flags of load_settings: flag > env > file > default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, ClassVar

import msgspec
import pytest

from libs.bus import Service
from libs.bus.settings import (
    ENGINE_KEYS,
    LAUNCHER_KEYS,
    SECTIONS,
    ServiceSettings,
    SettingsError,
    describe,
    load_settings,
)
from libs.worker.settings import WorkerSettings


class EngineSettings(ServiceSettings, frozen=True, kw_only=True):
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "page_size": ("block_size",),
        "enable_prefix_cache": ("enable_prefix_caching",),
    }

    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, description="batch size")] = 64
    max_prefill_tokens: int = 2048
    page_size: int = 16
    enable_prefix_cache: bool = True
    label: str = ""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "moemesh.yaml"
    path.write_text(text)
    return path


def load(argv=(), env=None) -> EngineSettings:
    return load_settings(EngineSettings, "decode-worker", list(argv), env=env or {})


def test_each_layer_beats_the_one_below(tmp_path):
    cfg = write(tmp_path, "max_num_seqs: 8\nmax_prefill_tokens: 512\npage_size: 32\n")
    env = {"MOEMESH_CONFIG": str(cfg), "MOEMESH_DECODE_WORKER_MAX_PREFILL_TOKENS": "256"}
    s = load(["--max-num-seqs", "5"], env)
    assert (s.max_num_seqs, s.max_prefill_tokens, s.page_size, s.label) == (5, 256, 32, "")
    assert load(env=env).max_num_seqs == 8  # the file, no flag
    assert load().max_num_seqs == 64  # no file: the default


def test_config_flag_and_section_beating_the_top_level(tmp_path):
    cfg = write(
        tmp_path,
        "max_num_seqs: 8\ndecode-worker:\n  max_num_seqs: 12\n  label: d\nprefill-worker:\n  max_num_seqs: 3\n",
    )
    s = load(["--config", str(cfg)])
    assert (s.max_num_seqs, s.label) == (12, "d")
    assert load_settings(EngineSettings, "prefill-worker", [f"--config={cfg}"], env={}).max_num_seqs == 3


def test_only_engine_keys_are_read_from_the_top_level(tmp_path):
    cfg = write(tmp_path, "decode_workers: 2\ndevice: cpu\nmax_num_seqs: 9\n")
    # a gateway-like class has none of the engine keys: the top level sets nothing for it
    assert load_settings(ServiceSettings, "gateway", ["--config", str(cfg)], env={}) == ServiceSettings()
    assert load(["--config", str(cfg)]).max_num_seqs == 9


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("max_num_seq: 8\n", r"unknown key 'max_num_seq' in config file .*moemesh.yaml"),
        ("decode-worker:\n  lable: x\n", r"unknown key 'lable' in section 'decode-worker' of config file"),
        ("decode-worker: 3\n", "section 'decode-worker' must be a mapping"),
        ("- 1\n", "expected a mapping"),
        ("max_num_seqs: [\n", "not valid YAML"),
        ("max_num_seqs: 0\n", r"max_num_seqs.*moemesh.yaml: max_num_seqs=0"),
    ],
)
def test_bad_files_name_the_key_and_the_file(tmp_path, text, match):
    cfg = write(tmp_path, text)
    with pytest.raises(SettingsError, match=match):
        load(["--config", str(cfg)])


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(SettingsError, match="nope.yaml"):
        load(env={"MOEMESH_CONFIG": str(tmp_path / "nope.yaml")})


def test_alias_flags_and_bool_flags(tmp_path):
    s = load(["--block-size", "32", "--no-enable-prefix-caching"])
    assert (s.page_size, s.enable_prefix_cache) == (32, False)
    cfg = write(tmp_path, "enable_prefix_cache: false\n")
    assert load(["--config", str(cfg), "--enable-prefix-cache"]).enable_prefix_cache is True
    assert load(["--config", str(cfg)]).enable_prefix_cache is False
    with pytest.raises(SettingsError, match="unknown command-line arguments"):
        load(["--block-sizes", "32"])


def test_worker_settings_take_vllm_names():
    s = load_settings(
        WorkerSettings, "decode-worker",
        ["--model-dir", "/m", "--block-size", "32", "--max-num-batched-tokens", "512", "--num-gpu-blocks-override",
         "100", "--no-enable-prefix-caching", "--num-speculative-tokens", "2", "--max-num-seqs", "7"],
        env={},
    )  # fmt: skip
    assert (s.page_size, s.max_prefill_tokens, s.num_pages, s.enable_prefix_cache, s.mtp_k, s.max_num_seqs) == (
        32, 512, 100, False, 2, 7,
    )  # fmt: skip


def test_engine_and_launcher_keys_name_real_settings():
    worker_fields = {d.name for d in describe(WorkerSettings)}
    assert set(ENGINE_KEYS) <= worker_fields
    assert not set(ENGINE_KEYS) & set(LAUNCHER_KEYS)
    top = {k.replace("_", "-") for k in (*ENGINE_KEYS, *LAUNCHER_KEYS)}
    assert not top & set(SECTIONS)  # a top-level key never reads as a section, nor a section as a key


def test_every_field_has_a_description():
    assert [d.name for d in describe(WorkerSettings) if not d.description] == []
    assert describe(EngineSettings)[-5].description == "batch size"


def test_settings_endpoint_masks_secrets():
    svc = Service(ServiceSettings(nats_url="nats://u:pw@h:4222", nats_password="pw", instance_id="x"))
    status, ctype, body = svc._route("GET", "/settings")
    got = json.loads(body)
    assert status == "200 OK" and ctype == "application/json"
    assert (
        got["nats_password"] == "***"
        and got["nats_url"] == "nats://u:***@h:4222"
        and got["instance_id"] == "x"
    )
