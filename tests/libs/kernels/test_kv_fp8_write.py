"""The fused RoPE + latent-norm + KV write into FP8 rows: the same bytes as the torch format's quantize."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.engine.kv_fp8 import Fp8Rows  # noqa: E402
from libs.kernels import fused as F  # noqa: E402

FMT = Fp8Rows(512, 64)
TENSOR = Fp8Rows(512, 64, "tensor")


def test_layout_constants_match_the_format():
    from libs.engine.kv_fp8 import TENSOR_SCALE

    assert (FMT.scale_offset, FMT.row_bytes) == (F.FP8_SCALE_OFFSET, F.FP8_ROW_BYTES)
    assert (TENSOR.row_bytes, TENSOR_SCALE) == (F.FP8_TENSOR_ROW_BYTES, F.FP8_TENSOR_SCALE)


@pytest.mark.parametrize("norm", [False, True])
def test_fp8_rows_written_as_the_torch_format_writes_them(device, norm):
    t, h = 4, 16
    g = torch.Generator().manual_seed(0)
    cs = F.rope_cos_sin(64, device=device)
    pos = torch.tensor([0, 5, 63, 9], device=device)
    q_pe = torch.randn(t, h, 64, generator=g).to(device)
    k_pe = torch.randn(t, 64, generator=g).to(device)
    c_kv = (torch.randn(t, 512, generator=g) * torch.tensor([1.0, 30.0, 1e-3, 0.0])[:, None]).to(device)
    w = (torch.rand(512, generator=g) + 0.5).to(device)
    kv = torch.full((12, FMT.row_bytes), 0xAB, dtype=torch.uint8, device=device)
    slots = torch.tensor([7, 2, 11, 0], device=device)
    q_out = torch.empty(t, h, 64, device=device)
    F.rope_and_write_kv(q_pe, q_out, k_pe, c_kv, kv, pos, slots, cs, kv_norm=w if norm else None, eps=1e-6)
    lat = F.add_rmsnorm_reference(c_kv, w, 1e-6) if norm else c_kv
    want = FMT.quantize(torch.cat([lat, F.rope_reference(k_pe, pos, cs)], -1))
    got = kv[slots]
    codes = [x[:, :512].contiguous().view(torch.float8_e4m3fn).float() for x in (got, want)]
    assert torch.equal(*codes)  # exact scaling and one rounding, as torch's (a zero's sign aside)
    scales = FMT.scale_offset, FMT.scale_offset + 4
    assert torch.equal(got[:, slice(*scales)], want[:, slice(*scales)])
    rope_got = got[:, 512 : FMT.scale_offset].contiguous().view(torch.bfloat16).float()
    rope_want = want[:, 512 : FMT.scale_offset].contiguous().view(torch.bfloat16).float()
    torch.testing.assert_close(rope_got, rope_want, rtol=1e-2, atol=1e-2)  # one bf16 ulp: fp32 rope math
    untouched = torch.ones(12, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (kv[untouched] == 0xAB).all()
    torch.testing.assert_close(q_out, F.rope_reference(q_pe, pos, cs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_rows_written_as_the_torch_format_writes_them(device, dtype):
    t, h = 4, 16
    g = torch.Generator().manual_seed(1)
    cs = F.rope_cos_sin(64, device=device)
    pos = torch.tensor([3, 0, 40, 63], device=device)
    q_pe = torch.randn(t, h, 64, generator=g).to(device, dtype)
    k_pe = (torch.randn(t, 64, generator=g) * 4).to(device, dtype)
    scale = torch.tensor([1.0, 1000.0, 1e-3, 0.0])[:, None]  # row 1 past +-448: clamped, not NaN
    c_kv = (torch.randn(t, 512, generator=g) * scale).to(device, dtype)
    kv = torch.full((9, TENSOR.row_bytes), 0xAB, dtype=torch.uint8, device=device)
    slots = torch.tensor([8, 1, 4, 0], device=device)
    q_out = torch.empty(t, h, 64, device=device, dtype=dtype)
    F.rope_and_write_kv(q_pe, q_out, k_pe, c_kv, kv, pos, slots, cs, kv_norm=None)
    want = TENSOR.quantize(torch.cat([c_kv, F.rope_reference(k_pe, pos, cs)], -1))
    got = kv[slots]
    assert torch.equal(got[:, :512].view(torch.float8_e4m3fn).float(), want[:, :512].view(torch.float8_e4m3fn).float())
    values = [TENSOR.dequantize(x, torch.float32) for x in (got, want)]
    assert not values[0].isnan().any() and values[0][1, :512].abs().max() == 448.0
    # the rope is computed in float32 by both; a value on a rounding edge may land one FP8 step apart
    torch.testing.assert_close(values[0][:, 512:], values[1][:, 512:], rtol=0.13, atol=2.0**-9)
    untouched = torch.ones(9, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (kv[untouched] == 0xAB).all()
