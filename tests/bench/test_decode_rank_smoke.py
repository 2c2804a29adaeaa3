"""bench/decode_rank's decode step on CPU at toy sizes under Triton's interpreter: every op of the step
(fused norm+quant, FP8 projections, paged MLA decode, routing, masked MoE, sampling) runs, times nothing
and checks no values (the interpreter's bf16 dot is not IEEE: see the kernels' conftest). The numbers are
the GPU's to measure; this keeps the benchmark's code path from rotting between device runs."""

from __future__ import annotations

import pytest
import torch

from tests.libs.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real benchmark")


def test_decode_step_runs_every_op_at_toy_size(monkeypatch):
    import bench.decode_rank as R
    from libs.kernels.mla_decode import MLAConfig

    for name, value in dict(D=256, QR=128, HEADS=16, LAYERS=3, DENSE_LAYERS=1, INTER_DENSE=256, INTER_MOE=128,
                            EXPERTS=32, VOCAB=500, DEV="cpu").items():  # fmt: skip
        monkeypatch.setattr(R, name, value)
    torch.manual_seed(0)
    rank = R.build_rank(max_b=2, max_ctx=80, local_experts=4, mla_cfg=MLAConfig())
    bt = R.make_batch(rank, 2, ctx=64, gen=8, max_ctx=80)
    rank.dense_fp8 = "block"  # row-wise needs torch._scaled_mm, CUDA only
    nxt = R.decode_step(rank, bt, {"attn", "moe", "other"})
    assert nxt.shape == (2,) and int(nxt.min()) >= 0 and int(nxt.max()) < 500
