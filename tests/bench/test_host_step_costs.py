"""bench.host_step_costs at a small size: every row timed and the record written (the memo's correctness is
tests/libs/engine/test_cuda_graph.py's)."""

from __future__ import annotations

from pathlib import Path

from bench.host_step_costs import main


def test_every_row_is_timed(tmp_path: Path) -> None:
    rec = main(["--batch", "8", "--context", "100", "--iters", "5", "--output", str(tmp_path / "r.json")])
    assert set(rec["ms"]) == {
        "fill_full", "fill_memo", "fill_full_churn", "fill_memo_churn", "extend_hashes", "cache_insert",
        "cache_insert_known_prompt",
    }  # fmt: skip
    assert all(v > 0 for v in rec["ms"].values())
    assert (tmp_path / "r.json").is_file()
