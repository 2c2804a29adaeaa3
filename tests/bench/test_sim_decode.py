"""bench/sim_decode.py: its settings parsing, and one small A/B pair through the real mesh (sim workers,
moemesh bench's slow-down), every request served on both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim_decode import main, settings_of


def test_settings_parse_and_refuse_what_is_not_a_moemesh_setting() -> None:
    assert settings_of("") == {}
    assert settings_of("MOEMESH_A_B=1, MOEMESH_C=x=y") == {"MOEMESH_A_B": "1", "MOEMESH_C": "x=y"}
    for bad in ("PATH=/x", "MOEMESH_A"):
        with pytest.raises(ValueError, match="MOEMESH_"):
            settings_of(bad)


@pytest.mark.e2e
def test_one_pair_serves_every_request_on_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "sim_decode.json"
    rec = main([
        "--b", "MOEMESH_DECODE_WORKER_OVERLAP_PUBLISH=true", "--pairs", "1", "--concurrency", "4",
        "--input-len", "100", "--output-len", "12", "--output", str(out),
    ])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec))
    assert [r["side"] for r in rec["runs"]] == ["A", "B"]
    for run in rec["runs"]:
        assert (run["completed"], run["failed"]) == (4, 0) and run["full_batch_tok_s"] > 0
        assert run["decode_worker_steps"]["tokens"] >= 4 * 11
