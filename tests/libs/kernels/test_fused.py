"""Fused residual-add RMSNorm and RoPE + KV-row write vs their torch oracles."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels import fused as F  # noqa: E402


def test_add_rmsnorm_updates_residual(device):
    x = torch.randn(3, 300).to(torch.bfloat16).to(device)
    res = torch.randn(3, 300).to(torch.bfloat16).to(device)
    w = torch.rand(300).to(device)
    res2 = res.clone()
    out = F.add_rmsnorm(x, w, 1e-6, residual=res)
    ref = F.add_rmsnorm_reference(x, w, 1e-6, residual=res2)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(res, res2)
    torch.testing.assert_close(
        F.add_rmsnorm(x, w, 1e-6), F.add_rmsnorm_reference(x, w, 1e-6), rtol=2e-2, atol=2e-2
    )


def test_add_rmsnorm_quant_equals_norm_then_quantize(device):
    """Same residual update as add_rmsnorm; the FP8 row dequantizes to the fp32 norm within e4m3's
    rounding, and each 128-group's scale is its amax / 448."""
    from libs.quant.fp8 import quantize_fp8_groups

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 384, generator=g).to(device)
    w = (1 + 0.1 * torch.randn(384, generator=g)).to(device)
    res = torch.randn(6, 384, generator=g).to(device)
    res2 = res.clone()
    xq, xs = F.add_rmsnorm_quant(x, w, 1e-6, residual=res)
    xf = x.float() + res2.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    torch.testing.assert_close(res, xf.to(res.dtype))
    rq, rs = quantize_fp8_groups(ref)
    torch.testing.assert_close(xs, rs, rtol=1e-5, atol=1e-7)
    deq = (xq.float().view(6, 3, 128) * xs[..., None]).view(6, 384)
    assert ((deq - ref).norm() / ref.norm()).item() < 3e-2
    with pytest.raises(ValueError, match="multiple of 128"):
        F.add_rmsnorm_quant(x[:, :100].contiguous(), w[:100], 1e-6)


@pytest.mark.parametrize("h", [4, 32])  # 32 heads: two 16-head programs per token
def test_rope_and_kv_write(device, h):
    t = 3
    cs = F.rope_cos_sin(64, device=device)
    pos = torch.tensor([0, 5, 63], device=device)
    q = torch.randn(t, h, 192, device=device)
    q_pe = q[..., 128:]  # strided view, as the q_b projection's output
    k_pe, c_kv = torch.randn(t, 64, device=device), torch.randn(t, 512, device=device)
    kv = torch.full((16, 576), float("nan"), device=device)
    slots = torch.tensor([7, 2, 11], device=device)
    q_out = torch.empty(t, h, 64, device=device)
    F.rope_and_write_kv(q_pe, q_out, k_pe, c_kv, kv, pos, slots, cs)
    torch.testing.assert_close(q_out, F.rope_reference(q_pe, pos, cs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[slots, 512:], F.rope_reference(k_pe, pos, cs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[slots, :512], c_kv)
    untouched = torch.ones(16, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert kv[untouched].isnan().all()
    raw = torch.randn(t, 512, device=device) * 3  # the kv_a output before its norm, fused
    w = torch.rand(512, device=device) + 0.5
    F.rope_and_write_kv(q_pe, q_out, k_pe, raw, kv, pos, slots, cs, kv_norm=w, eps=1e-6)
    torch.testing.assert_close(kv[slots, :512], F.add_rmsnorm_reference(raw, w, 1e-6), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two head count"):
        F.rope_and_write_kv(q_pe[:, :3], q_out[:, :3], k_pe, c_kv, kv, pos, slots, cs)
    # in place (the fused prefill path rotates q's rope part where it lies): the same rotation, nothing else moved
    before = q.clone()
    F.rope_and_write_kv(q_pe, q_pe, k_pe, c_kv, kv, pos, slots, cs)
    torch.testing.assert_close(q[..., 128:], F.rope_reference(before[..., 128:], pos, cs), rtol=1e-5, atol=1e-5)
    assert torch.equal(q[..., :128], before[..., :128])
