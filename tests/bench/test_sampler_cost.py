"""bench/sampler_cost on the CPU at a tiny batch: every row of the record is timed through the engine's own
sampling code, and the module stays importable on the GPU machine (torch and triton, no msgspec, NATS or
xgrammar: the grammar's host-fill row is the only one that needs xgrammar)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bench.sampler_cost as S


def test_cpu_record_has_every_row(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    record = S.main(["--device", "cpu", "--batch", "2", "--iters", "1"])
    (path,) = tmp_path.glob("sampler_cost-*.json")
    assert json.loads(path.read_text()) == [record]
    assert record["benchmark"] == "sampler_cost" and record["batch"] == 2 and record["vocab"] == 129_280
    want = {
        "sample_greedy", "sample_exact_temperature", "sample_exact_top_p_top_k", "apply_penalties",
        "accept_counts", "apply_logit_bias", "apply_min_tokens", "apply_grammar_mask", "apply_all",
        "step_all_on", "step_off", "grammar_fill_host",
    }  # fmt: skip
    assert set(record["ms"]) == want  # sample_one_pass is CUDA only
    assert all(ms > 0 for ms in record["ms"].values())


def test_processors_really_process() -> None:
    """The rows time work that changes the logits: each processed row differs from the raw one."""
    import torch

    logits = torch.randn(2, S.V)
    for name, params in S.processing_params().items():
        procs, seqs = S.processors(2, "cpu", params)
        out = procs.apply(logits, seqs)
        assert out is not logits and not torch.equal(out, logits), name


def test_imports_no_bus_or_grammar_library() -> None:
    code = (
        "import sys, bench.sampler_cost; "
        "print(sorted(m for m in ('msgspec', 'nats', 'xgrammar', 'fastapi') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    ).stdout
    assert out.strip() == "[]"
