"""`moemesh up --prefill-gpus/--decode-gpus`: each worker's CUDA_VISIBLE_DEVICES (its kind's list split in
order, ep_size each) and the refusals; `--reasoning-parser` reaches the gateways only when given."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.cli.main import build_parser
from libs.cli.up import mesh_config
from libs.launch.gpu_placement import parse_gpus, split_gpus


def parse(*argv: str):
    return build_parser().parse_args(["up", *argv])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_one_box_prefill_and_decode_pools(model: Path) -> None:
    args = parse("--model", str(model), "--ep-size", "4", "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7")
    cfg, _ = mesh_config(args, {})
    assert cfg.worker_gpus == {"prefill-0": "0,1,2,3", "decode-0": "4,5,6,7"}
    args = parse("--model", str(model), "--ep-size", "2", "--decode-workers", "2", "--prefill-workers", "0",
                 "--decode-gpus", "7,6,5,4")  # fmt: skip
    assert mesh_config(args, {})[0].worker_gpus == {"decode-0": "7,6", "decode-1": "5,4"}
    assert mesh_config(parse("--model", str(model)), {})[0].worker_gpus == {}  # inherited


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--decode-gpus", "0,1,2"), r"--decode-gpus names 3 GPUs; 1 worker\(s\) x ep_size 2 need 2"),
        (("--prefill-gpus", "0,1", "--decode-gpus", "1,2"), r"GPU\(s\) \[1\] given to both"),
        (("--decode-gpus", "0,x"), "GPU ids separated by commas"),
        (("--decode-gpus", "3,3"), "distinct"),
    ],
)
def test_bad_gpu_lists_are_refused(model: Path, flags: tuple[str, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mesh_config(parse("--model", str(model), "--ep-size", "2", *flags), {})


def test_split_is_pure_and_ordered() -> None:
    assert parse_gpus("", "--x") == [] and split_gpus([], ["a"], 8, "--x") == {}
    assert split_gpus(parse_gpus("0,1,2,3,4,5,6,7", "--x"), ["a", "b"], 4, "--x") == {"a": "0,1,2,3", "b": "4,5,6,7"}


def test_reasoning_parser_flag_reaches_the_gateways_only_when_given(model: Path) -> None:
    cfg, _ = mesh_config(parse("--model", str(model), "--reasoning-parser", "deepseek_r1"), {})
    assert cfg.extra_env["services.gateway"] == {"MOEMESH_GATEWAY_REASONING_PARSER": "deepseek_r1"}
    assert "services.gateway" not in mesh_config(parse("--model", str(model)), {})[0].extra_env
    with pytest.raises(SystemExit):
        parse("--reasoning-parser", "qwen3")
