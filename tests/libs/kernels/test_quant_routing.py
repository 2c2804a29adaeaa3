"""Activation quantization (plain and fused SwiGLU) and the fused router vs their torch oracles."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels import quant as Q  # noqa: E402
from libs.kernels.routing import route, route_reference  # noqa: E402
from libs.quant.fp8 import quantize_fp8_groups  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402


def test_quant_matches_reference_bit_for_bit(device):
    x = (torch.randn(5, 384) * torch.logspace(-3, 3, 384)).to(torch.bfloat16).to(device)
    xq, xs = Q.quant_fp8_groups(x)
    rq, rs = quantize_fp8_groups(x)
    torch.testing.assert_close(xs, rs, rtol=1e-6, atol=0)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


def test_quant_heads_gathers_a_per_head_layout_into_token_rows(device):
    per_head = (torch.randn(3, 5, 128) * torch.logspace(-2, 2, 128)).to(torch.bfloat16).to(device)  # [H, T, 128]
    xq, xs = Q.quant_fp8_heads(per_head.transpose(0, 1))  # seen as [T, H, 128]: no copy made
    rq, rs = quantize_fp8_groups(per_head.transpose(0, 1).reshape(5, 3 * 128))
    assert xq.shape == (5, 384) and xs.shape == (5, 3)
    torch.testing.assert_close(xs, rs, rtol=1e-6, atol=0)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        Q.quant_fp8_heads(per_head.transpose(1, 2))


def test_silu_mul_quant_skips_rows_past_counts(device):
    gu = torch.randn(2, 6, 512).to(torch.bfloat16).to(device)
    counts = torch.tensor([3, 6], dtype=torch.int32, device=device)
    q, s = Q.silu_mul_quant(gu, counts)
    rq, rs = quantize_fp8_groups(Q.silu_mul_reference(gu))
    torch.testing.assert_close(s[0, :3], rs[0, :3], rtol=1e-5, atol=0)
    torch.testing.assert_close(s[1], rs[1], rtol=1e-5, atol=0)
    ok = (q.float() - rq.float()).abs() <= rq.float().abs() / 8 + 1e-6  # within one fp8 step
    assert ok[0, :3].all() and ok[1].all()


def test_quant_rejects_ragged_width(device):
    with pytest.raises(ValueError, match="multiple of 128"):
        Q.quant_fp8_groups(torch.randn(2, 100, device=device))


@pytest.mark.parametrize("t", [1, 9])
def test_route_matches_transformers_router(device, t):
    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, 256, generator=g).to(device)
    bias = (torch.randn(256, generator=g) * 0.5).to(device)
    w, ids = route(logits, bias, 8, 8, 4, 2.5)
    rw, rids = route_reference(logits, bias, 8, 8, 4, 2.5)
    mine, theirs = ids.long().sort(-1), rids.long().sort(-1)
    assert torch.equal(mine.values, theirs.values)
    torch.testing.assert_close(w.gather(1, mine.indices), rw.gather(1, theirs.indices))


def test_route_appends_the_shared_expert_column(device):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 256, generator=g).to(torch.bfloat16).to(device)  # bf16: cast in the kernel
    bias = (torch.randn(256, generator=g) * 0.5).to(device)
    w, ids = route(logits, bias, 8, 8, 4, 2.5, shared_expert=256)
    plain_w, plain_ids = route(logits, bias, 8, 8, 4, 2.5)
    assert ids.shape == w.shape == (5, 9)
    assert torch.equal(ids[:, :8], plain_ids) and torch.equal(w[:, :8], plain_w)
    assert (ids[:, 8] == 256).all() and (w[:, 8] == 1.0).all()


def test_route_rejects_bad_grouping(device):
    with pytest.raises(ValueError, match="groups"):
        route(torch.randn(2, 96, device=device), torch.zeros(96, device=device), 8, 3, 2, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_route_real_batch_on_gpu():
    logits = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda") * 0.1
    w, ids = route(logits, bias, 8, 8, 4, 2.5)
    rw, rids = route_reference(logits, bias, 8, 8, 4, 2.5)
    assert torch.equal(ids.long().sort(-1).values, rids.long().sort(-1).values)
