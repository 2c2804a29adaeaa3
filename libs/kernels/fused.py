"""Small fused kernels of the decode step that would otherwise be many tiny launches per layer: residual add +
RMSNorm (alone or straight into 1x128 FP8), and MLA's RoPE + latent-row write into the paged KV cache, in
DeepSeek-V3's interleaved RoPE convention with the de-interleaved output layout transformers uses."""

# Input pairs (x[2i], x[2i+1]) rotate by position * inv_freq[i]; the output is [rotated evens | rotated odds],
# the same for q and k, so their dot products are RoPE's.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.quant.fp8 import FP8_DTYPE as FP8
from libs.quant.fp8 import FP8_GROUP as GROUP
from libs.quant.fp8 import FP8_MAX

# DeepSeek's FP8 latent rows (libs/engine/kv_fp8.Fp8Rows(512, 64)): "token" rows' byte offset of the scale
# and row bytes; "tensor" rows' bytes and scale (kv_fp8.TENSOR_SCALE)
FP8_SCALE_OFFSET, FP8_ROW_BYTES = 512 + 2 * 64, 656
FP8_TENSOR_ROW_BYTES, FP8_TENSOR_SCALE = 576, 1.0


@triton.jit
def _add_rmsnorm_kernel(
    X, R, W, OUT, N, eps, stride_x, stride_r, stride_o, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(R + row * stride_r + offs, x.to(R.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, 0) / N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps) * w
    tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """RMSNorm of x (+ residual, which is updated in place to x + residual) over the last dim, x [T, N]."""
    t, n = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.shape != x.shape):
        raise ValueError("add_rmsnorm needs [T, N] rows with a contiguous last dim and a same-shape residual")
    out = out if out is not None else torch.empty_like(x)
    r = residual if residual is not None else x
    _add_rmsnorm_kernel[(t,)](
        x, r, weight, out, n, eps, x.stride(0), r.stride(0), out.stride(0),
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=8 if n > 2048 else 4,
    )  # fmt: skip
    return out


def add_rmsnorm_reference(x, weight, eps, residual=None):
    xf = x.float() + (residual.float() if residual is not None else 0)
    if residual is not None:
        residual.copy_(xf.to(residual.dtype))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@triton.jit
def _add_rmsnorm_quant_kernel(
    X, R, W, XQ, XS, N, eps, stride_x, stride_r, stride_q, stride_s,
    HAS_RES: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr, FMAX: tl.constexpr,
):  # fmt: skip
    """The row as [groups, 128]: the norm reduces over both axes, the FP8 scale over each group."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_POW2)
    offs = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(R + row * stride_r + offs, x.to(R.dtype.element_ty), mask=mask)
    var = tl.sum(tl.sum(x * x, 1), 0) / N
    y = x * tl.rsqrt(var + eps) * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), 1), 1e-10) / FMAX
    tl.store(XQ + row * stride_q + offs, (y / scale[:, None]).to(XQ.dtype.element_ty), mask=mask)
    tl.store(XS + row * stride_s + g, scale, mask=g * GROUP_SIZE < N)


def add_rmsnorm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """add_rmsnorm straight into DeepSeek's 1x128 FP8 activation format for the next projection, one
    launch instead of two (the normalized row is quantized from fp32, never rounded to bf16 between):
    x [T, N] -> (xq [T, N] float8_e4m3fn, xs [T, N/128] float32); residual updated in place as there."""
    t, n = x.shape
    if x.stride(-1) != 1 or n % GROUP or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"add_rmsnorm_quant needs [T, N] rows (N a multiple of {GROUP}) with a contiguous last dim and a "
            "same-shape residual"
        )
    xq = torch.empty(t, n, dtype=FP8, device=x.device)
    xs = torch.empty(t, n // GROUP, dtype=torch.float32, device=x.device)
    r = residual if residual is not None else x
    _add_rmsnorm_quant_kernel[(t,)](
        x, r, weight, xq, xs, n, eps, x.stride(0), r.stride(0), xq.stride(0), xs.stride(0),
        HAS_RES=residual is not None, GROUPS_POW2=triton.next_power_of_2(n // GROUP), GROUP_SIZE=GROUP,
        FMAX=FP8_MAX, num_warps=8 if n > 2048 else 4,
    )  # fmt: skip
    return xq, xs


@triton.jit
def _pow2_scale(amax):
    """The FP8 row's scale and its inverse from a float32 amax (libs/engine/kv_fp8.pow2_scale, bit for bit)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 253)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rope_kv_kernel(
    QPE, QOUT, KPE, CKV, KV, KVR, KVS, POS, SLOTS, COS_SIN, NORM_W, eps,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_cb, stride_kv, stride_kvr, stride_kvs,
    stride_cs, BLOCK_H: tl.constexpr, HALF: tl.constexpr, D_LAT: tl.constexpr, NORM: tl.constexpr,
    FP8_ROWS: tl.constexpr, SCALE_IDX: tl.constexpr, TENSOR_ROWS: tl.constexpr, INV_SCALE: tl.constexpr,
):  # fmt: skip
    """Program (token b, head block): rotates BLOCK_H heads of q; the first head block also writes the
    token's cache row (its latent RMS-normed first when NORM). Pairs are loaded as whole contiguous rows and
    split in registers. FP8_ROWS: KV, KVR and KVS are the fp8, bf16 and fp32 views of "token" FP8 row bytes;
    TENSOR_ROWS: KV is the fp8 view of "tensor" rows, every value rounded to the inputs' dtype first (the
    plain path's row) and scaled by INV_SCALE, clamped to +-448."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    pos = tl.load(POS + b)
    i = tl.arange(0, HALF)
    cos = tl.load(COS_SIN + pos * stride_cs + i)
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + i)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, 2 * HALF)
    q = tl.load(QPE + b * stride_qb + h[:, None] * stride_qh + d[None, :]).to(tl.float32)
    q0, q1 = tl.split(tl.reshape(q, [BLOCK_H, HALF, 2]))  # interleaved pairs (x[2i], x[2i+1])
    o = QOUT + b * stride_ob + h[:, None] * stride_oh + i[None, :]
    tl.store(o, (q0 * cos - q1 * sin).to(QOUT.dtype.element_ty))
    tl.store(o + HALF, (q0 * sin + q1 * cos).to(QOUT.dtype.element_ty))
    if hb == 0:
        k0, k1 = tl.split(tl.reshape(tl.load(KPE + b * stride_kb + d).to(tl.float32), [HALF, 2]))
        slot = tl.load(SLOTS + b).to(tl.int64)
        row = KV + slot * stride_kv
        c = tl.arange(0, D_LAT)
        lat = tl.load(CKV + b * stride_cb + c).to(tl.float32)
        if NORM:  # as add_rmsnorm without a residual
            lat = lat * tl.rsqrt(tl.sum(lat * lat, 0) / D_LAT + eps) * tl.load(NORM_W + c).to(tl.float32)
            lat = lat.to(CKV.dtype.element_ty)
        if FP8_ROWS:  # [codes | bf16 k_pe | scale]: the latent quantized from the value the plain path writes
            rope = KVR + slot * stride_kvr + D_LAT // 2
            tl.store(rope + i, (k0 * cos - k1 * sin).to(tl.bfloat16))
            tl.store(rope + HALF + i, (k0 * sin + k1 * cos).to(tl.bfloat16))
            lat = lat.to(tl.float32)
            scale, inv = _pow2_scale(tl.max(tl.abs(lat), 0))
            tl.store(row + c, (lat * inv).to(KV.dtype.element_ty))
            tl.store(KVS + slot * stride_kvs + SCALE_IDX, scale)
        elif TENSOR_ROWS:
            r0 = (k0 * cos - k1 * sin).to(KPE.dtype.element_ty).to(tl.float32) * INV_SCALE
            r1 = (k0 * sin + k1 * cos).to(KPE.dtype.element_ty).to(tl.float32) * INV_SCALE
            tl.store(row + D_LAT + i, tl.clamp(r0, -448.0, 448.0).to(KV.dtype.element_ty))
            tl.store(row + D_LAT + HALF + i, tl.clamp(r1, -448.0, 448.0).to(KV.dtype.element_ty))
            lat = lat.to(CKV.dtype.element_ty).to(tl.float32) * INV_SCALE
            tl.store(row + c, tl.clamp(lat, -448.0, 448.0).to(KV.dtype.element_ty))
        else:
            tl.store(row + D_LAT + i, (k0 * cos - k1 * sin).to(KV.dtype.element_ty))
            tl.store(row + D_LAT + HALF + i, (k0 * sin + k1 * cos).to(KV.dtype.element_ty))
            tl.store(row + c, lat.to(KV.dtype.element_ty))


def rope_and_write_kv(
    q_pe, q_out, k_pe, c_kv, kv_layer, positions, slots, cos_sin, kv_norm: torch.Tensor | None = None, eps=1e-6
) -> None:
    """Rotate q_pe [T, H, 64] (H a power of two) into q_out and write each token's latent row [c_kv (512) |
    rotated k_pe (64)] at slots [T] of kv_layer [slots, 576] (uint8 [slots, 656] or [slots, 576]: FP8 rows of
    the "token" or "tensor" layout, engine/kv_fp8.py); cos_sin [max_pos, 64] is cos then sin per position.
    kv_norm [512]: RMS-norm the raw c_kv with it."""
    # That is MLA's kv_a_layernorm, rounded to c_kv's dtype as add_rmsnorm's output would be.
    t, h, r = q_pe.shape
    raw = kv_layer.dtype == torch.uint8
    fp8, tensor = raw and kv_layer.shape[-1] == FP8_ROW_BYTES, raw and kv_layer.shape[-1] == FP8_TENSOR_ROW_BYTES
    if r != 64 or c_kv.shape[-1] != 512 or (kv_layer.shape[-1] != 576 and not fp8) or k_pe.shape != (t, 64):
        raise ValueError(
            "rope_and_write_kv expects 64-dim rope parts, 512-dim c_kv and 576-dim cache rows "
            f"({FP8_ROW_BYTES} or {FP8_TENSOR_ROW_BYTES} bytes as FP8 rows)"
        )
    if h & (h - 1) or q_pe.stride(2) != 1 or k_pe.stride(1) != 1:
        raise ValueError(f"rope_and_write_kv needs a power-of-two head count and contiguous rows, got {h} heads")
    if t == 0:
        return
    block_h = min(h, 16)  # 128 heads: 8 programs per token, each 16 rows of 64
    kv, kvr, kvs = (kv_layer.view(FP8), kv_layer.view(torch.bfloat16), kv_layer.view(torch.float32)) if fp8 else (
        kv_layer.view(FP8) if tensor else kv_layer, kv_layer, kv_layer
    )
    _rope_kv_kernel[(t, h // block_h)](
        q_pe, q_out, k_pe, c_kv, kv, kvr, kvs, positions, slots, cos_sin,
        kv_norm if kv_norm is not None else cos_sin, eps,
        q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1), k_pe.stride(0), c_kv.stride(0),
        kv.stride(0), kvr.stride(0), kvs.stride(0), cos_sin.stride(0), BLOCK_H=block_h, HALF=32, D_LAT=512,
        NORM=kv_norm is not None, FP8_ROWS=fp8, SCALE_IDX=FP8_SCALE_OFFSET // 4, TENSOR_ROWS=tensor,
        INV_SCALE=1.0 / FP8_TENSOR_SCALE, num_warps=2,
    )  # fmt: skip


def rope_cos_sin(max_pos: int, base: float = 10000.0, dim: int = 64, device="cpu") -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).to(device)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., 64] interleaved pairs -> de-interleaved rotated, as transformers' DeepseekV3."""
    cs = cos_sin[positions.long()]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (32,)
    cos, sin = cs[:, :32].view(shape), cs[:, 32:].view(shape)
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).to(x.dtype)
