"""The expanded keys' concatenation kernel against torch.cat of the same view and broadcast."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels.mla_prefill import concat_k  # noqa: E402


@pytest.mark.parametrize("h", [3, 16, 40])  # fewer heads than a block, one block, a partial last block
def test_concat_k_equals_torch_cat_of_the_strided_view(device, h):
    g = torch.Generator().manual_seed(h)
    kv = torch.randn(5, h, 32 + 16, generator=g).to(device)  # the kv_b output: [T, H, N + V], N = 32
    rows = torch.randn(5, 24, generator=g).to(device)  # latent rows whose last 8 values are the RoPE part
    k_nope, k_pe = kv[..., :32], rows[:, -8:]
    got = concat_k(k_nope, k_pe)
    want = torch.cat([k_nope, k_pe[:, None].expand(5, h, 8)], dim=-1)
    assert got.shape == (5, h, 40) and got.is_contiguous()
    assert torch.equal(got, want)  # a copy: bit-equal


def test_concat_k_casts_the_rope_part_and_takes_no_tokens(device):
    k_nope = torch.randn(2, 4, 16).to(device, torch.float16)
    k_pe = torch.randn(2, 8).to(device)  # float32 rows, float16 keys
    got = concat_k(k_nope, k_pe)
    assert got.dtype == torch.float16
    assert torch.equal(got[..., 16:], k_pe.to(torch.float16)[:, None].expand(2, 4, 8))
    assert concat_k(k_nope[:0], k_pe[:0]).shape == (0, 4, 24)


def test_concat_k_refuses_what_it_cannot_read(device):
    with pytest.raises(ValueError, match="contiguous last dims"):
        concat_k(torch.randn(2, 4, 16, device=device).transpose(1, 2), torch.randn(2, 8, device=device))
    with pytest.raises(ValueError, match="power-of-two"):
        concat_k(torch.randn(2, 4, 12, device=device), torch.randn(2, 8, device=device))
