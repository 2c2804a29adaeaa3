"""The FP8 MLA decode kernel (FP8 dots over FP8 rows) against float32 attention over the dequantized rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.engine.kv_fp8 import Fp8Rows  # noqa: E402
from libs.kernels.mla_decode import MLAConfig, mla_decode_reference  # noqa: E402
from libs.kernels.mla_decode_fp8 import dequantize_rows, mla_decode_fp8, mla_decode_fp8_reference  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402

SMALL = MLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=1)  # FP8 dots: K >= 32 on a GPU
FMT = Fp8Rows(512, 64)


def _case(device, heads, page_size, lens, seed=0, row_spread=1.0):
    g = torch.Generator().manual_seed(seed)
    batch, max_pages = len(lens), max(-(-n // page_size) for n in lens)
    num_pages = batch * max_pages + 3
    rows = torch.randn(num_pages * page_size, 576, generator=g)
    rows[:, :512] *= torch.exp(torch.randn(num_pages * page_size, 1, generator=g) * row_spread)  # per-token range
    kv = FMT.quantize(rows)
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages).int()
    q = torch.randn(batch, heads, 576, generator=g).to(torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), kv.to(device), table.to(device), seq.to(device)


def _run(q, kv, table, seq, page_size, scale, **kw):
    return mla_decode_fp8(q[..., :512], kv, table, seq, page_size, scale, q_rope=q[..., 512:], **kw)


def _ref(q, kv, table, seq, page_size, scale):
    return mla_decode_fp8_reference(q[..., :512], q[..., 512:], kv, table, seq, page_size, scale)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_attention_over_the_dequantized_rows(device, num_splits):
    q, kv, table, seq = _case(device, 16, 16, [1, 37, 70], row_spread=2.0)
    out = torch.full((3, 16, 512), float("nan"), dtype=q.dtype, device=device)
    _run(q, kv, table, seq, 16, 0.07, num_splits=num_splits, cfg=SMALL, out=out)
    assert not out.isnan().any()
    # what is left once q is rounded as the kernel rounds it: the FP8 probabilities and bf16 output (~0.5%)
    assert _rel(out, _ref(q, kv, table, seq, 16, 0.07)) < 1.5e-2
    # against exact attention over the same rows: FP8 q adds its error (measured 0.6-7% on random q)
    assert _rel(out, mla_decode_reference(q.float(), dequantize_rows(kv), table, seq, 16, 0.07)) < 1e-1


@pytest.mark.parametrize("dots", ["fp8-qk", "bf16"])
def test_bf16_products_over_the_same_rows(device, dots):
    q, kv, table, seq = _case(device, 16, 16, [1, 37, 70], row_spread=2.0)
    out = _run(q, kv, table, seq, 16, 0.07, num_splits=3, cfg=SMALL, dots=dots)
    exact = mla_decode_reference(q.float(), dequantize_rows(kv), table, seq, 16, 0.07)
    # bf16 PV: only bf16 rounding of the probabilities and output (~0.4%) beyond the FP8 query ("fp8-qk")
    assert _rel(out, _ref(q, kv, table, seq, 16, 0.07) if dots == "fp8-qk" else exact) < 1e-2


def test_small_tiles_and_unknown_dots_are_refused(device):
    q, kv, table, seq = _case(device, 16, 16, [3])
    with pytest.raises(ValueError, match="dots"):
        _run(q, kv, table, seq, 16, 0.1, cfg=SMALL, dots="int8")
    with pytest.raises(ValueError, match="32"):
        _run(q, kv, table, seq, 16, 0.1, cfg=MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1))


def test_dequantized_rows_are_the_torch_formats(device):
    _, kv, _, _ = _case(device, 16, 16, [5])
    torch.testing.assert_close(dequantize_rows(kv).cpu(), FMT.dequantize(kv.cpu(), torch.float32))


def test_empty_splits_and_zero_rows_stay_finite(device):
    # 8 splits of short sequences (most empty); one sequence's rows all zero (a zeroed pool): no NaN
    q, kv, table, seq = _case(device, 16, 8, [20, 5], seed=1)
    kv[table[1].long().repeat_interleave(8) * 8 + torch.arange(8, device=device).repeat(table.shape[1])] = 0
    out = _run(q, kv, table, seq, 8, 0.1, num_splits=8, cfg=SMALL)
    assert out.isfinite().all()
    assert _rel(out[0], _ref(q, kv, table, seq, 8, 0.1)[0]) < 1.5e-2 and out[1].abs().max() == 0


def test_rejects_rows_that_are_not_fp8_rows(device):
    q, kv, table, seq = _case(device, 16, 16, [3])
    with pytest.raises(ValueError, match="uint8 rows"):
        _run(q, dequantize_rows(kv).to(q.dtype), table, seq, 16, 0.1, cfg=SMALL)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("dots", ["fp8", "fp8-qk", "bf16"])
def test_real_shapes_on_gpu(heads, dots):
    from libs.kernels.mla_decode import choose_num_splits

    lens = [2048, 1, 3000, 517, 64, 2100, 1999, 8]
    q, kv, table, seq = _case("cuda", heads, 64, lens, seed=3, row_spread=1.0)
    cfg = MLAConfig()
    splits = choose_num_splits(len(lens), heads, 3000, cfg)
    out = _run(q, kv, table, seq, 64, 0.1352, num_splits=splits, cfg=cfg, dots=dots)
    exact = mla_decode_reference(q.float(), dequantize_rows(kv), table, seq, 64, 0.1352)
    assert _rel(out, exact if dots == "bf16" else _ref(q, kv, table, seq, 64, 0.1352)) < 1.5e-2
