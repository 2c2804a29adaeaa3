"""Row-wise FP8 dense GEMMs through `torch._scaled_mm` (one scale per token, one per output channel), the
per-token / per-channel FP8 vLLM and SGLang offer, an accuracy trade against DeepSeek's block scales: a
checkpoint weight is requantized once at load (dequantize 128x128 blocks, then row amax / 448)."""

#   out[m, n] = (xq[m, :] . wq[n, :]) * xs[m] * ws[n]
# Why: torch's `_scaled_mm` on SM90 takes row-wise but not block scales, and its row-wise kernels run
# decode-sized projections much faster than the Triton block-scaled kernel. Lost: the within-row scale
# variation of the weight, and the activation's per-128-group scale (an outlier coarsens the whole token).
# `_scaled_mm` wants (torch 2.11, SM90): a row-major [M, K] fp8, b column-major [K, N] fp8 (`wq.t()`), K and N
# multiples of 16, scale_a [M, 1] and scale_b [1, N] float32 contiguous, bf16 output.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.kernels.fp8_gemm import dequant_blocks
from libs.quant.fp8 import FP8_DTYPE as FP8
from libs.quant.fp8 import FP8_GROUP as GROUP
from libs.quant.fp8 import FP8_MAX

_ROWS_PER_CHUNK = 1024  # rows dequantized at a time at load: bounds the fp32 copy of a large weight


def requant_rowwise(w: torch.Tensor, w_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled weight w [N, K] fp8 with w_s [ceil(N/128), K/128] -> (wq [N, K] fp8 row-major,
    ws [1, N] float32): wq[n] * ws[n] ~= dequant(w, w_s)[n]. Load-time work, not for a decode step."""
    if w.dtype != FP8 or w.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if k % GROUP or w_s.shape != (triton.cdiv(n, GROUP), k // GROUP):
        raise ValueError(f"weight scale shape {tuple(w_s.shape)} does not match weight {tuple(w.shape)}")
    wq = torch.empty_like(w)
    ws = torch.empty(1, n, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, n)
        wf = dequant_blocks(w[r0:r1], w_s[r0 // GROUP : triton.cdiv(r1, GROUP)])
        s = wf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        wq[r0:r1] = (wf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        ws[0, r0:r1] = s
    return wq, ws


@triton.jit
def _quant_row_kernel(X, XQ, XS, stride_xm, stride_qm, K: tl.constexpr, SWIGLU: tl.constexpr,
                      BLOCK: tl.constexpr, FMAX: tl.constexpr):  # fmt: skip
    """One program per row: pass 1 finds the row's amax, pass 2 (re-reading, from L2) quantizes."""
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_xm
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        if SWIGLU:  # X holds [gate | up], each K wide
            up = tl.load(x_row + K + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            x = x / (1.0 + tl.exp(-x)) * up
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), 1e-10) / FMAX
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        if SWIGLU:
            up = tl.load(x_row + K + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            x = x / (1.0 + tl.exp(-x)) * up
        tl.store(
            XQ + row.to(tl.int64) * stride_qm + k0 + offs, (x / scale).to(XQ.dtype.element_ty), mask=mask
        )
    tl.store(XS + row, scale)


def quant_rows(x: torch.Tensor, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8: x [M, K] (rows with a contiguous last dim) -> (xq [M, K] fp8, xs [M, 1] f32),
    x ~= xq * xs. With swiglu, x is [M, 2I] (gate first) and SiLU(gate) * up [M, I] is quantized."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quant_rows needs [M, K] rows with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape
    if swiglu and k % 2:
        raise ValueError(f"gate_up width {k} must be even")
    k = k // 2 if swiglu else k
    xq = torch.empty(m, k, dtype=FP8, device=x.device)
    xs = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_row_kernel[(m,)](x, xq, xs, x.stride(0), xq.stride(0), K=k, SWIGLU=swiglu,
                                BLOCK=min(2048, triton.next_power_of_2(k)), FMAX=FP8_MAX, num_warps=4)  # fmt: skip
    return xq, xs


def scaled_mm_rowwise(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """xq [M, K] fp8, xs [M, 1] f32, wq [N, K] fp8 (row-major), ws [1, N] f32 -> [M, N] bf16.
    Shape checks only (host metadata, no device sync): safe inside CUDA-graph capture."""
    m, k = xq.shape
    n = wq.shape[0]
    if xq.dtype != FP8 or wq.dtype != FP8 or wq.shape[1] != k:
        raise ValueError(
            f"need fp8 [M, K] x fp8 [N, K], got {xq.dtype} {tuple(xq.shape)}, {wq.dtype} {tuple(wq.shape)}"
        )
    if k % 16 or n % 16:
        raise ValueError(f"_scaled_mm needs K ({k}) and N ({n}) multiples of 16")
    if xs.shape != (m, 1) or ws.shape != (1, n):
        raise ValueError(
            f"row-wise scales must be [M, 1] and [1, N], got {tuple(xs.shape)} and {tuple(ws.shape)}"
        )
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype)


def linear_rowwise(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """y = x @ (wq * ws).T with x quantized per token on the fly; x [M, K] bf16 -> [M, N] bf16."""
    xq, xs = quant_rows(x, swiglu)
    return scaled_mm_rowwise(xq, xs, wq, ws)


def quant_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return (xf / s).to(FP8), s


def rowwise_reference(xq, xs, wq, ws) -> torch.Tensor:
    """Dequantize both sides in float32 and multiply: the oracle for `scaled_mm_rowwise`."""
    return (xq.float() * xs) @ (wq.float() * ws.t()).t()


def error_vs_dequantized(y: torch.Tensor, ref: torch.Tensor) -> dict:
    """Errors of a projection's output y against the float32 reference ref (same shape):
    max |y - ref|, that over max |ref|, and ||y - ref|| / ||ref||."""
    d = (y.float() - ref.float()).abs()
    ref_max = float(ref.float().abs().max())
    max_abs = float(d.max())
    return {"max_abs": max_abs, "max_abs_over_ref_max": max_abs / max(ref_max, 1e-30),
            "rel_fro": float(d.norm() / ref.float().norm().clamp(min=1e-30))}  # fmt: skip
