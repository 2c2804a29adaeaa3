"""MLA decode (absorbed form) over FP8 latent rows (libs/engine/kv_fp8.Fp8Rows(512, 64), 656 bytes) with QK and
PV as FP8 tensor-core dots: a Triton split-K kernel with mla_decode's grid, splits and combine, and its
float32 torch reference (everything but the probabilities' FP8 rounding)."""

# Per tile of BLOCK_N rows, the latent's 512 columns in four 128-wide chunks each with its own dots and accumulator:
# - QK: the latent query quantized per head row (its amax to 448) times the codes as an FP8 dot, scaled by
#   q_scale[h] * k_scale[n]; the 64-wide rope part a bf16 dot against the bf16 k_pe.
# - PV: the probabilities times each row's scale quantized to FP8 in units of the largest row scale seen so far
#   (so they span FP8's range and never overflow), times the codes as an FP8 dot; the accumulator stays in
#   those units, rescaled when the unit grows.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.kernels.fused import FP8_ROW_BYTES, FP8_SCALE_OFFSET
from libs.kernels.mla_decode import (
    LATENT_DIM,
    ROPE_DIM,
    MLAConfig,
    _lat_chunk,
    _mla_combine_kernel,
    _store_lat_chunk,
    mla_decode_reference,
)

FP8_MAX = 448.0
DOTS = ("fp8", "fp8-qk", "bf16")
DECODE_DOTS = "bf16"  # the Engine's: exact products over the codes (bench.kernels times every mode)


@triton.jit
def _codes(KV8, slot, stride_kv8, mask_n, c: tl.constexpr, CH: tl.constexpr):
    """Columns [c * CH, (c + 1) * CH) of the tile's FP8 codes [BLOCK_N, CH] (masked rows 0)."""
    offs = c * CH + tl.arange(0, CH)
    return tl.load(KV8 + slot[:, None] * stride_kv8 + offs[None, :], mask=mask_n[:, None], other=0.0)


@triton.jit
def _q_operand(q, q_inv, QK_FP8: tl.constexpr):
    """A latent query chunk as QK's A operand: FP8 times q_inv per head row (its amax to FP8's largest), or
    bf16."""
    if QK_FP8:
        return (q * q_inv[:, None]).to(tl.float8e4nv)
    else:
        return q.to(tl.bfloat16)


@triton.jit
def _qk(q, k8, acc, QK_FP8: tl.constexpr):
    if QK_FP8:
        return tl.dot(q, tl.trans(k8), acc)
    else:
        return tl.dot(q, tl.trans(k8.to(tl.bfloat16)), acc)


@triton.jit
def _pv(p, k8, acc, PV_FP8: tl.constexpr):
    if PV_FP8:
        return tl.dot(p, k8, acc)
    else:  # bf16 holds every e4m3 code exactly
        return tl.dot(p, k8.to(tl.bfloat16), acc)


@triton.jit
def _mla_fp8_split_kernel(
    QL, QR, KV8, KVR, KVS, PT, SEQ, O, OPART, LSE, sm_scale_log2,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_kv8, stride_kvr, stride_kvs, stride_ptb, stride_ptp,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_SPLITS, PAGE_SIZE: tl.constexpr, DIRECT_OUT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, ROPE_IDX: tl.constexpr,
    SCALE_IDX: tl.constexpr, FMAX: tl.constexpr, QK_FP8: tl.constexpr, PV_FP8: tl.constexpr,
):  # fmt: skip
    # The latent's 512 columns as four 128-wide chunks, each with its own dots and accumulator: one
    # [BLOCK_H, 512] tile in registers at a time (the query, the widened codes) spilled at 64 x 64 tiles.
    CH: tl.constexpr = D_LAT // 4
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, D_ROPE)
    q_rows = QL + b * stride_qb + offs_h[:, None] * stride_qh
    q0 = _lat_chunk(q_rows, 0, CH).to(tl.float32)
    q1 = _lat_chunk(q_rows, 1, CH).to(tl.float32)
    q2 = _lat_chunk(q_rows, 2, CH).to(tl.float32)
    q3 = _lat_chunk(q_rows, 3, CH).to(tl.float32)
    if QK_FP8:  # per head row: its amax over all 512 columns to FP8's largest value
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), 1), tl.max(tl.abs(q1), 1)),
                          tl.maximum(tl.max(tl.abs(q2), 1), tl.max(tl.abs(q3), 1)))  # fmt: skip
        amax = tl.maximum(amax, 1e-30)
        q_inv = FMAX / amax
        q_scale = amax / FMAX
    else:
        q_inv = tl.full([BLOCK_H], 1.0, tl.float32)
        q_scale = q_inv
    q0 = _q_operand(q0, q_inv, QK_FP8)
    q1 = _q_operand(q1, q_inv, QK_FP8)
    q2 = _q_operand(q2, q_inv, QK_FP8)
    q3 = _q_operand(q3, q_inv, QK_FP8)
    q_rope = tl.load(QR + b * stride_rb + offs_h[:, None] * stride_rh + offs_r[None, :]).to(tl.bfloat16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)  # sum of p * v per chunk, in units of `unit`
    acc1 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    unit = tl.full([], 1e-30 if PV_FP8 else 1.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(PT + b * stride_ptb + (offs_n // PAGE_SIZE) * stride_ptp, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k0 = _codes(KV8, slot, stride_kv8, mask_n, 0, CH)
        k1 = _codes(KV8, slot, stride_kv8, mask_n, 1, CH)
        k2 = _codes(KV8, slot, stride_kv8, mask_n, 2, CH)
        k3 = _codes(KV8, slot, stride_kv8, mask_n, 3, CH)
        k_rope = tl.load(
            KVR + slot[:, None] * stride_kvr + ROPE_IDX + offs_r[None, :], mask=mask_n[:, None], other=0.0
        )
        k_scale = tl.load(KVS + slot * stride_kvs + SCALE_IDX, mask=mask_n, other=0.0)
        qk = _qk(q0, k0, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), QK_FP8)
        qk = _qk(q1, k1, qk, QK_FP8)
        qk = _qk(q2, k2, qk, QK_FP8)
        qk = _qk(q3, k3, qk, QK_FP8)
        qk = tl.dot(q_rope, tl.trans(k_rope), qk * (q_scale[:, None] * k_scale[None, :]))
        qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV_FP8:  # each row's scale into the probabilities, in units of the largest row scale seen so far
            new_unit = tl.maximum(unit, tl.max(k_scale, 0) / FMAX)  # never shrinks: p8 <= 448, rescale <= 1
            pv = (p * (k_scale / new_unit)[None, :]).to(tl.float8e4nv)
            alpha = alpha * (unit / new_unit)
            unit = new_unit
        else:
            pv = (p * k_scale[None, :]).to(tl.bfloat16)
        acc0 = _pv(pv, k0, acc0 * alpha[:, None], PV_FP8)
        acc1 = _pv(pv, k1, acc1 * alpha[:, None], PV_FP8)
        acc2 = _pv(pv, k2, acc2 * alpha[:, None], PV_FP8)
        acc3 = _pv(pv, k3, acc3 * alpha[:, None], PV_FP8)
        m_i = m_new

    has = l_i > 0
    scale = unit / tl.where(has, l_i, 1.0)
    if DIRECT_OUT:
        ptr = O + b * stride_ob + offs_h[:, None] * stride_oh
    else:
        ptr = OPART + b * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + split, lse)
    _store_lat_chunk(ptr, acc0, scale, 0, CH)
    _store_lat_chunk(ptr, acc1, scale, 1, CH)
    _store_lat_chunk(ptr, acc2, scale, 2, CH)
    _store_lat_chunk(ptr, acc3, scale, 3, CH)


def mla_decode_fp8(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    q_rope: torch.Tensor,
    num_splits: int = 1,
    cfg: MLAConfig | None = None,
    out: torch.Tensor | None = None,
    dots: str = "fp8",
) -> torch.Tensor:
    """q [B, H, 512] (latent query, any batch/head strides) and q_rope [B, H, 64] attend over each sequence's
    FP8 rows -> [B, H, 512] in q's dtype. kv_rows: one layer's row bytes [slots, 656] uint8; page_table
    [B, max_pages] int32 (any strides), seq_lens [B] int32 (>= 1 each), as mla_decode takes them. dots: which
    products run on FP8 tensor cores, one of DOTS ("fp8": QK and PV; "fp8-qk": QK; "bf16": neither)."""
    if dots not in DOTS:
        raise ValueError(f"dots must be one of {DOTS}, got {dots!r}")
    cfg = cfg or MLAConfig()
    B, H, D = q.shape
    if D != LATENT_DIM or q_rope.shape != (B, H, ROPE_DIM):
        raise ValueError(f"FP8 MLA decode expects 512 + 64-dim q, got {tuple(q.shape)}, {tuple(q_rope.shape)}")
    if kv_rows.dtype != torch.uint8 or kv_rows.dim() != 2 or kv_rows.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"FP8 MLA decode expects [slots, {FP8_ROW_BYTES}] uint8 rows, got {kv_rows.dtype} "
                         f"{tuple(kv_rows.shape)}")  # fmt: skip
    if cfg.block_n < 32:  # an FP8 tensor-core dot's K (PV's is the tile's rows) is at least 32 on a GPU
        raise ValueError(f"FP8 MLA decode needs tiles of at least 32 rows, got block_n={cfg.block_n}")
    block_h = min(cfg.block_h, max(16, triton.next_power_of_2(H)))
    if H % block_h:
        raise ValueError(f"num_heads {H} must be a multiple of the head block {block_h}")
    if page_table.dim() != 2 or page_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("page_table must be [B, max_pages] and seq_lens [B]")
    if q.stride(-1) != 1 or q_rope.stride(-1) != 1 or kv_rows.stride(-1) != 1:
        raise ValueError("q and kv_rows need a contiguous last dimension")
    kv8, kvr, kvs = kv_rows.view(torch.float8_e4m3fn), kv_rows.view(torch.bfloat16), kv_rows.view(torch.float32)
    out = out if out is not None else torch.empty(B, H, LATENT_DIM, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        opart = torch.empty(B, H, num_splits, LATENT_DIM, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    else:
        opart, lse = out, out  # unused by the kernel when NUM_SPLITS == 1
    _mla_fp8_split_kernel[(H // block_h, num_splits, B)](
        q, q_rope, kv8, kvr, kvs, page_table, seq_lens, out, opart, lse, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), kv8.stride(0), kvr.stride(0),
        kvs.stride(0), page_table.stride(0), page_table.stride(1), out.stride(0), out.stride(1),
        opart.stride(0), opart.stride(1), opart.stride(2) if num_splits > 1 else 0, lse.stride(0), lse.stride(1),
        num_splits, PAGE_SIZE=page_size, DIRECT_OUT=num_splits == 1, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        D_LAT=LATENT_DIM, D_ROPE=ROPE_DIM, ROPE_IDX=LATENT_DIM // 2, SCALE_IDX=FP8_SCALE_OFFSET // 4, FMAX=FP8_MAX,
        QK_FP8=dots != "bf16", PV_FP8=dots == "fp8",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _mla_combine_kernel[(H, B)](
            opart, lse, out,
            opart.stride(0), opart.stride(1), opart.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits), D_LAT=LATENT_DIM, num_warps=4,
        )  # fmt: skip
    return out


def dequantize_rows(kv_rows: torch.Tensor) -> torch.Tensor:
    """[slots, 656] FP8 row bytes -> [slots, 576] float32 values (c_kv codes * scale, then k_pe)."""
    codes = kv_rows[:, :LATENT_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = kv_rows[:, FP8_SCALE_OFFSET : FP8_SCALE_OFFSET + 4].contiguous().view(torch.float32)
    rope = kv_rows[:, LATENT_DIM:FP8_SCALE_OFFSET].contiguous().view(torch.bfloat16).float()
    return torch.cat([codes * scale, rope], dim=-1)


def mla_decode_fp8_reference(
    q: torch.Tensor, q_rope: torch.Tensor, kv_rows: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    """The kernel's math in float32 torch but for the FP8 rounding of the probabilities: q quantized per head
    row as the kernel does, attention over the dequantized rows -> [B, H, 512] float32."""
    lat = q.float()
    amax = lat.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    lat = (lat * (FP8_MAX / amax)).to(torch.float8_e4m3fn).float() * (amax / FP8_MAX)
    full = torch.cat([lat, q_rope.to(torch.bfloat16).float()], dim=-1)
    return mla_decode_reference(full, dequantize_rows(kv_rows), page_table, seq_lens, page_size, sm_scale)
