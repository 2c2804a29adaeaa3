"""Activation quantization to FP8 with one scale per token and 128-wide group (DeepSeek's 1x128), alone or
fused with the SwiGLU before every expert's down projection: scale = max(|x| over the group, 1e-10) / 448,
xq = x / scale as float8_e4m3fn, so x ~= xq * scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.quant.fp8 import FP8_DTYPE as FP8
from libs.quant.fp8 import FP8_GROUP as GROUP
from libs.quant.fp8 import FP8_MAX


@triton.jit
def _quant_rows_kernel(
    X, XQ, XS, K, stride_xm, stride_xg, stride_qm, stride_sm, M_MAX, COUNTS,
    SWIGLU: tl.constexpr, MASKED: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr,
    FMAX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    valid = True
    if MASKED:
        valid = (row % M_MAX) < tl.load(COUNTS + row // M_MAX)
    if valid:
        g = tl.arange(0, GROUPS_POW2)
        c = tl.arange(0, GROUP_SIZE)
        offs = g[:, None] * GROUP_SIZE + c[None, :]
        mask = offs < K
        x_row = X + row.to(tl.int64) * stride_xm
        x_offs = g[:, None] * stride_xg + c[None, :]  # stride_xg: GROUP_SIZE unless gathering heads
        x = tl.load(x_row + x_offs, mask=mask, other=0.0).to(tl.float32)
        if SWIGLU:  # X holds [gate | up], each K wide
            up = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
            x = x / (1.0 + tl.exp(-x)) * up
        amax = tl.max(tl.abs(x), 1)
        scale = tl.maximum(amax, 1e-10) / FMAX
        xq = (x / scale[:, None]).to(XQ.dtype.element_ty)
        tl.store(XQ + row.to(tl.int64) * stride_qm + offs, xq, mask=mask)
        tl.store(XS + row.to(tl.int64) * stride_sm + g, scale, mask=g * GROUP_SIZE < K)


def _quant(x2d: torch.Tensor, k: int, swiglu: bool, counts: torch.Tensor | None, m_max: int, stride_xg=GROUP):
    rows = x2d.shape[0]
    if k % GROUP:
        raise ValueError(f"quantized width {k} must be a multiple of {GROUP}")
    if x2d.stride(-1) != 1:
        raise ValueError("rows to quantize need a contiguous last dimension")
    xq = torch.empty(rows, k, dtype=FP8, device=x2d.device)
    xs = torch.empty(rows, k // GROUP, dtype=torch.float32, device=x2d.device)
    if rows == 0:
        return xq, xs
    _quant_rows_kernel[(rows,)](
        x2d, xq, xs, k, x2d.stride(0), stride_xg, xq.stride(0), xs.stride(0), m_max,
        counts if counts is not None else xs,
        SWIGLU=swiglu, MASKED=counts is not None, GROUPS_POW2=triton.next_power_of_2(k // GROUP),
        GROUP_SIZE=GROUP, FMAX=FP8_MAX, num_warps=4,
    )  # fmt: skip
    return xq, xs


def quant_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq [..., K] fp8, xs [..., K/128] f32)."""
    k = x.shape[-1]
    xq, xs = _quant(x.reshape(-1, k), k, False, None, 1)
    return xq.view(x.shape), xs.view(*x.shape[:-1], k // GROUP)


def quant_fp8_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, G, 128] with any T and G strides (MLA's per-head W_UV output [H, T, 128] seen as [T, H, 128])
    -> (xq [T, G * 128] fp8, xs [T, G] f32): the gather into token rows happens in the quantization, no copy."""
    t, g, c = x.shape
    if c != GROUP or x.stride(-1) != 1:
        raise ValueError(f"quant_fp8_heads needs [T, G, {GROUP}] with a contiguous last dimension, got {tuple(x.shape)}")
    return _quant(x.as_strided((t, g * c), (x.stride(0), 1)), g * c, False, None, 1, stride_xg=x.stride(1))


def silu_mul_quant(gate_up: torch.Tensor, counts: torch.Tensor | None = None):
    """SwiGLU then quantize: gate_up [..., 2I] (gate first) -> (q [..., I] fp8, s [..., I/128]).

    With counts (masked layout, gate_up [E, M_max, 2I]) rows at or past counts[e] are skipped."""
    i2 = gate_up.shape[-1]
    if i2 % 2:
        raise ValueError(f"gate_up width {i2} must be even")
    i = i2 // 2
    m_max = gate_up.shape[-2] if counts is not None else 1
    if counts is not None and (gate_up.dim() != 3 or counts.shape != (gate_up.shape[0],)):
        raise ValueError("masked silu_mul_quant needs gate_up [E, M_max, 2I] and counts [E]")
    xq, xs = _quant(gate_up.reshape(-1, i2), i, True, counts, m_max)
    return xq.view(*gate_up.shape[:-1], i), xs.view(*gate_up.shape[:-1], i // GROUP)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, -1)
    return torch.nn.functional.silu(g) * u
