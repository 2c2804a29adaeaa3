"""A cold start on a GPU gives one greedy answer wherever it runs: two separate processes started side by side
with an empty Triton cache and an empty user tuning folder (as two workers of a fresh machine) and this
process's Engine decode the same prompts to the same token ids, and no process times a kernel or writes a
table (serving takes a table's entry or the fixed default). Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import HAS_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

ROOT = Path(__file__).parents[3]
DIMS = dict(
    hidden_size=1024, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
    qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
)  # fmt: skip
# lengths across several buckets of M, decoded together (the decode graphs' batch of 4)
PROMPTS = [[3 + (11 * i + 5 * p) % 500 for i in range(n)] for p, n in enumerate((5, 37, 130, 300))]
MAX_TOKENS = 24

DECODE = """
import json, sys
from libs.engine import Engine, SamplingParams
from libs.kernels import gemm_tuning
engine = Engine.from_pretrained(sys.argv[1], device="cuda")
params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True)
outs = engine.generate(json.loads(sys.argv[2]), params)
print(json.dumps({"ids": [o.token_ids for o in outs], "timed": gemm_tuning.SPENT["timings"]}))
"""


def test_two_cold_processes_and_the_engine_give_the_same_greedy_tokens(tmp_path, monkeypatch) -> None:
    import torch

    from libs.engine import Engine, SamplingParams
    from libs.engine.tiny import write_tiny_model
    from libs.kernels import fp8_gemm, gemm_tuning

    model = write_tiny_model(tmp_path / "model", seed=3, fp8=True, **DIMS)
    triton_cache, tuning = tmp_path / "triton-cache", tmp_path / "tuning"
    triton_cache.mkdir()
    tuning.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache), gemm_tuning.CACHE_ENV: str(tuning)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-c", DECODE, str(model), json.dumps(PROMPTS), str(MAX_TOKENS)]
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # started side by side, both compiling into the one empty cache
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    # this process as the servers see it: the shipped tables, the same empty user folder, no earlier choice
    monkeypatch.setattr(gemm_tuning, "SHIPPED_DIR", Path(gemm_tuning.__file__).parent / "tuning")
    monkeypatch.setattr(gemm_tuning, "_STORED", None)
    monkeypatch.setenv(gemm_tuning.CACHE_ENV, str(tuning))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    for name in ("_TRITON_CONFIG", "_KERNEL_CHOICE", "_SPLIT_CHOICE"):
        monkeypatch.setattr(fp8_gemm, name, {})
    engine = Engine.from_pretrained(model, device="cuda")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    here = [o.token_ids for o in engine.generate(PROMPTS, params)]
    del engine
    torch.cuda.empty_cache()

    assert all(len(ids) == MAX_TOKENS for ids in here)
    assert results[0]["ids"] == here, "process 1 and the in-process Engine disagree"
    assert results[1]["ids"] == here, "process 2 and the in-process Engine disagree"
    assert [r["timed"] for r in results] == [0, 0]
    assert not list(tuning.iterdir())  # serving writes no table
    assert any(triton_cache.iterdir())  # the processes did compile into the cold cache
