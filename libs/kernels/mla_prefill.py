"""Expanded MLA prefill's keys in one pass: each head's no-RoPE part (a strided view of the kv_b projection's
output) beside the RoPE part every head shares, written as the [T, H, N + r] tensor the prefill attention
kernels take; the same copy as torch.cat of the view and the broadcast RoPE part (bench/NOTES-decode.md says
what that cost in a profiled prefill forward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _concat_k_kernel(
    KN, KP, OUT, H, stride_nt, stride_nh, stride_pt, stride_ot, stride_oh,
    N: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_n = tl.arange(0, N)
    offs_r = tl.arange(0, R)
    k_nope = tl.load(KN + t * stride_nt + offs_h[:, None] * stride_nh + offs_n[None, :], mask=mask_h[:, None])
    k_pe = tl.load(KP + t * stride_pt + offs_r).to(OUT.dtype.element_ty)
    out = OUT + t * stride_ot + offs_h[:, None] * stride_oh
    tl.store(out + offs_n[None, :], k_nope.to(OUT.dtype.element_ty), mask=mask_h[:, None])
    tl.store(out + N + offs_r[None, :], tl.broadcast_to(k_pe[None, :], (BLOCK_H, R)), mask=mask_h[:, None])


def fits(n: int, r: int) -> bool:
    """Whether concat_k takes keys of N no-RoPE and r RoPE values (powers of two: Triton's block widths)."""
    return n > 0 and r > 0 and not (n & (n - 1) or r & (r - 1))


def concat_k(k_nope: torch.Tensor, k_pe: torch.Tensor, block_h: int = 16) -> torch.Tensor:
    """k_nope [T, H, N] (any token/head strides, contiguous last dim) and k_pe [T, r] -> [T, H, N + r] in
    k_nope's dtype: torch.cat([k_nope, k_pe[:, None].expand(T, H, r)], -1). N and r powers of two."""
    t, h, n = k_nope.shape
    r = k_pe.shape[-1]
    if k_pe.shape != (t, r) or k_nope.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError(f"concat_k needs k_nope [T, H, N] and k_pe [T, r] with contiguous last dims, got "
                         f"{tuple(k_nope.shape)} {tuple(k_nope.stride())} and {tuple(k_pe.shape)}")  # fmt: skip
    if not fits(n, r):
        raise ValueError(f"concat_k needs power-of-two widths, got N={n}, r={r}")
    out = k_nope.new_empty(t, h, n + r)
    if t:
        _concat_k_kernel[(t, triton.cdiv(h, block_h))](
            k_nope, k_pe, out, h, k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), out.stride(0),
            out.stride(1), N=n, R=r, BLOCK_H=block_h,
        )  # fmt: skip
    return out
