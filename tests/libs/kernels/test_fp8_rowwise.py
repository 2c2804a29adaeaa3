"""Row-wise FP8 (per-token activation, per-channel weight) GEMMs vs dequantize-then-multiply."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels import fp8_gemm as G  # noqa: E402
from libs.kernels import fp8_rowwise as R  # noqa: E402
from libs.kernels.quant import quant_fp8_groups  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402


def _block_weight(n, k, device, seed=0, spread=1.0):
    """fp8 weight with 128x128 scales; spread > 1 makes the scales of one row's blocks differ."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 2).to(G.FP8)
    ws = 0.01 * spread ** (2 * torch.rand(-(-n // 128), k // 128, generator=g) - 1)
    return w.to(device), ws.to(device)


def _x(m, k, device, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(device)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quant_rows_one_scale_per_token(device):
    x = _x(33, 384, device)
    x[3] *= 100  # a loud token keeps its own scale
    xq, xs = R.quant_rows(x)
    rq, rs = R.quant_rows_reference(x)
    assert xs.shape == (33, 1)
    torch.testing.assert_close(xs, rs, rtol=1e-6, atol=0)
    assert (xq.float().abs().amax(-1) == R.FP8_MAX).all()
    assert _rel(xq.float() * xs, x) < 3e-2
    assert (xq.float() != rq.float()).float().mean() < 0.01  # the same rounding up to float ties


def test_quant_rows_swiglu_long_row(device):
    gate_up = _x(5, 2 * 2304, device)  # I = 2304: more than one 2048-wide block per pass
    xq, xs = R.quant_rows(gate_up, swiglu=True)
    g, u = gate_up.float().chunk(2, -1)
    h = torch.nn.functional.silu(g) * u
    assert xq.shape == (5, 2304)
    assert _rel(xq.float() * xs, h) < 3e-2


def test_requant_keeps_the_dequantized_weight(device):
    w, ws = _block_weight(200, 256, device, spread=4.0)  # N not a multiple of 128
    wq, s = R.requant_rowwise(w, ws)
    assert wq.shape == w.shape and s.shape == (1, 200) and s.dtype == torch.float32
    ref = G.dequant_blocks(w, ws)
    assert _rel(wq.float() * s.t(), ref) < 4e-2
    assert (wq.float().abs().amax(-1) == R.FP8_MAX).all()


def test_linear_rowwise_matches_reference(device):
    w, ws = _block_weight(192, 256, device)
    wq, s = R.requant_rowwise(w, ws)
    x = _x(40, 256, device)
    y = R.linear_rowwise(x, wq, s)
    xq, xs = R.quant_rows(x)
    assert y.dtype == torch.bfloat16 and y.shape == (40, 192)
    assert _rel(y, R.rowwise_reference(xq, xs, wq, s)) < 1e-2
    assert _rel(y, x.float() @ G.dequant_blocks(w, ws).t()) < 6e-2


def test_outlier_channel_costs_rowwise_more_than_block(device):
    """The trade in one number: one loud channel coarsens the whole token under per-token scales,
    only its 128-group under DeepSeek's 1x128 scales."""
    w, ws = _block_weight(128, 512, device, spread=4.0)
    x = _x(16, 512, device)
    x[:, 7] *= 200
    ref = x.float() @ G.dequant_blocks(w, ws).t()
    xq, xs = quant_fp8_groups(x)
    block = R.error_vs_dequantized(G.fp8_gemm(xq, xs, w, ws), ref)
    rowwise = R.error_vs_dequantized(R.linear_rowwise(x, *R.requant_rowwise(w, ws)), ref)
    assert block["rel_fro"] < rowwise["rel_fro"]
    assert set(block) == {"max_abs", "max_abs_over_ref_max", "rel_fro"}


def test_rejects_bad_shapes(device):
    w, ws = _block_weight(128, 256, device)
    with pytest.raises(ValueError, match="scale shape"):
        R.requant_rowwise(w, ws[:, :1])
    with pytest.raises(ValueError, match="float8"):
        R.requant_rowwise(w.float(), ws)
    wq, s = R.requant_rowwise(w, ws)
    xq, xs = R.quant_rows(_x(4, 256, device))
    with pytest.raises(ValueError, match="row-wise scales"):
        R.scaled_mm_rowwise(xq, xs.t(), wq, s)
    with pytest.raises(ValueError, match="multiples of 16"):
        R.scaled_mm_rowwise(xq[:, :248].contiguous(), xs, wq[:, :248].contiguous(), s)
    with pytest.raises(ValueError, match="contiguous"):
        R.quant_rows(_x(256, 8, device).t())
    with pytest.raises(ValueError, match="even"):
        R.quant_rows(_x(2, 255, device), swiglu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m,n,k", [(256, 2112, 7168), (256, 7168, 16384), (7, 24576, 1536)])
def test_real_shapes_on_gpu_and_in_a_graph(m, n, k):
    w, ws = _block_weight(n, k, "cuda")
    wq, s = R.requant_rowwise(w, ws)
    x = _x(m, k, "cuda")
    xq, xs = R.quant_rows(x)
    y = R.linear_rowwise(x, wq, s)
    assert _rel(y, R.rowwise_reference(xq, xs, wq, s)) < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = R.linear_rowwise(x, wq, s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
