"""EP over NCCL on real GPUs (rank r on cuda:r) against the single-GPU Engine: ragged prefill logits and
greedy tokens, with and without redundant experts. Skipped without 2 CUDA devices (CI has none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.ep.engine import EPEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
RAGGED = [[(n + 7 * i) % 1000 + 3 for i in range(n)] for n in (1, 45, 9, 20, 3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ep-gpu") / "tiny", seed=0)


@pytest.mark.parametrize("redundant", [0, 2])
def test_nccl_ep2_equals_single_gpu(tiny: Path, redundant: int) -> None:
    ref = Engine.from_pretrained(tiny, device="cuda:0", dtype="float32", num_pages=64, max_prefill_tokens=32)
    want_logits = [ref.prefill_logits(p).cpu() for p in RAGGED]
    want_tokens = [o.token_ids for o in ref.generate(RAGGED, GREEDY)]
    with EPEngine(
        str(tiny),
        ep_size=2,
        device="cuda",
        dtype="float32",
        num_pages=64,
        max_prefill_tokens=32,
        ep_redundant_experts=redundant,
    ) as ep:
        got = ep.prefill_logits_many(RAGGED)
        for g, w in zip(got, want_logits, strict=True):
            torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4)
        assert [o.token_ids for o in ep.generate(RAGGED, GREEDY)] == want_tokens


@pytest.mark.parametrize("backend", ["fixed", "torch"])
def test_nccl_ep2_fp8_experts_equal_single_gpu_fp8(tmp_path: Path, backend: str) -> None:
    """FP8 experts kept FP8 on both ranks (quantization auto on CUDA), the grouped GEMMs, FP8 dispatch (the
    fixed dispatcher is the CUDA default; its fallback carries the forwards above max_num_seqs tokens)."""
    fp8 = write_tiny_model(
        tmp_path / "fp8", seed=1, fp8=True, moe_intermediate_size=128, intermediate_size=256
    )
    ref = Engine.from_pretrained(
        fp8, device="cuda:0", dtype="float32", num_pages=64, max_prefill_tokens=32, max_num_seqs=8
    )
    assert ref.model.model.layers[1].mlp.experts.is_fp8
    want_logits = [ref.prefill_logits(p).cpu() for p in RAGGED]
    want_tokens = [o.token_ids for o in ref.generate(RAGGED, GREEDY)]
    with EPEngine(
        str(fp8), ep_size=2, device="cuda", dtype="float32", num_pages=64, max_prefill_tokens=32, max_num_seqs=8, ep_backend=backend,
        ep_fp8_dispatch=True,
    ) as ep:  # fmt: skip
        for g, w in zip(ep.prefill_logits_many(RAGGED), want_logits, strict=True):
            torch.testing.assert_close(g.cpu(), w, atol=2e-3, rtol=2e-3)
        assert [o.token_ids for o in ep.generate(RAGGED, GREEDY)] == want_tokens
