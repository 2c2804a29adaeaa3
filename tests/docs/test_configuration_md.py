"""docs/configuration.md is what `python -m libs.cli.config_docs` prints from the settings classes, every
setting has a description, and the file's YAML example is a valid config for `up` and every service."""

from __future__ import annotations

from pathlib import Path

from libs.bus.settings import describe, load_settings
from libs.cli.config_docs import EXAMPLE, SETTINGS_CLASSES, render, settings_class
from libs.cli.main import build_parser
from libs.cli.up import resolve_options

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_md_is_generated_from_the_settings() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: regenerate it with `python -m libs.cli.config_docs > docs/configuration.md`"
    )


def test_every_setting_has_a_one_line_description() -> None:
    for section in SETTINGS_CLASSES:
        docs = describe(settings_class(section))
        missing = {d.name for d in docs if not d.description}
        assert not missing, (
            f"{section}: fields without Meta(description=...): {sorted(missing)} (describe them, then "
            "regenerate docs/configuration.md)"
        )
        assert all("\n" not in d.description for d in docs), section


def test_the_example_is_a_valid_config_file(tmp_path: Path) -> None:
    path = tmp_path / "moemesh.yaml"
    path.write_text(EXAMPLE)
    args = build_parser().parse_args(["up", "--config", str(path)])
    resolve_options(args, {})
    assert args.decode_workers == 2
    seqs = {}
    for section in SETTINGS_CLASSES:
        cls = settings_class(section)
        needs_model = "model_dir" in {d.name for d in describe(cls)}
        argv = ["--config", str(path), *(["--model-dir", str(tmp_path)] if needs_model else [])]
        seqs[section] = getattr(load_settings(cls, section, argv, env={}), "max_num_seqs", None)
    assert seqs == {
        "gateway": None, "scheduler": None, "kv-broker": None, "prefill-worker": 128, "decode-worker": 256,
    }  # fmt: skip
