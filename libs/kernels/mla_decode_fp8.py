"""MLA decode (absorbed form) over FP8 latent rows (libs/engine/kv_fp8.Fp8Rows(512, 64), 656 bytes) with QK and
PV as FP8 tensor-core dots: a Triton split-K kernel with mla_decode's grid, splits and combine, and its
float32 torch reference (everything but the probabilities' FP8 rounding)."""

# Per tile of BLOCK_N rows:
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
    combine_splits,
    mla_decode_reference,
    split_outputs,
)

FP8_MAX = 448.0
DOTS = ("fp8", "fp8-qk", "bf16")
DECODE_DOTS = "bf16"  # the Engine's: exact products over the codes (bench.kernels times every mode)


@triton.jit
def _mla_fp8_split_kernel(
    QL, QR, KV8, KVR, KVS, PT, SEQ, O, OPART, LSE, sm_scale_log2,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_kv8, stride_kvr, stride_kvs, stride_ptb, stride_ptp,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_SPLITS, PAGE_SIZE: tl.constexpr, DIRECT_OUT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, ROPE_IDX: tl.constexpr,
    SCALE_IDX: tl.constexpr, FMAX: tl.constexpr, QK_FP8: tl.constexpr, PV_FP8: tl.constexpr,
):  # fmt: skip
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_LAT)
    offs_r = tl.arange(0, D_ROPE)
    q = tl.load(QL + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :]).to(tl.float32)
    q_amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-30)
    if QK_FP8:
        q8 = (q * (FMAX / q_amax)[:, None]).to(tl.float8e4nv)
        q_scale = q_amax / FMAX
    else:
        q8 = q.to(tl.bfloat16)
        q_scale = tl.full([BLOCK_H], 1.0, tl.float32)
    q_rope = tl.load(QR + b * stride_rb + offs_h[:, None] * stride_rh + offs_r[None, :]).to(tl.bfloat16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], dtype=tl.float32)  # sum of p * v, in units of `unit`
    unit = tl.full([], 1e-30 if PV_FP8 else 1.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(PT + b * stride_ptb + (offs_n // PAGE_SIZE) * stride_ptp, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k8 = tl.load(KV8 + slot[:, None] * stride_kv8 + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        k_rope = tl.load(
            KVR + slot[:, None] * stride_kvr + ROPE_IDX + offs_r[None, :], mask=mask_n[:, None], other=0.0
        )
        k_scale = tl.load(KVS + slot * stride_kvs + SCALE_IDX, mask=mask_n, other=0.0)
        if QK_FP8:
            qk = tl.dot(q8, tl.trans(k8)) * (q_scale[:, None] * k_scale[None, :])
        else:
            qk = tl.dot(q8, tl.trans(k8.to(tl.bfloat16))) * k_scale[None, :]
        qk = tl.dot(q_rope, tl.trans(k_rope), qk)
        qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV_FP8:
            new_unit = tl.maximum(unit, tl.max(k_scale, 0) / FMAX)  # never shrinks: p8 <= 448, rescale <= 1
            p8 = (p * (k_scale / new_unit)[None, :]).to(tl.float8e4nv)
            acc = tl.dot(p8, k8, acc * (alpha * (unit / new_unit))[:, None])
            unit = new_unit
        else:  # bf16 holds every e4m3 code exactly; the row scales go into the probabilities
            pv = (p * k_scale[None, :]).to(tl.bfloat16)
            acc = tl.dot(pv, k8.to(tl.bfloat16), acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0
    out = acc * unit / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT_OUT:
        o_ptr = O + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty))
    else:
        p_ptr = OPART + b * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(p_ptr, out)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + split, lse)


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
    check_inputs(q, q_rope, kv_rows, page_table, seq_lens)
    B, H, _ = q.shape
    if cfg.block_n < 32:  # an FP8 tensor-core dot's K (PV's is the tile's rows) is at least 32 on a GPU
        raise ValueError(f"FP8 MLA decode needs tiles of at least 32 rows, got block_n={cfg.block_n}")
    block_h = min(cfg.block_h, max(16, triton.next_power_of_2(H)))
    if H % block_h:
        raise ValueError(f"num_heads {H} must be a multiple of the head block {block_h}")
    kv8, kvr, kvs = kv_rows.view(torch.float8_e4m3fn), kv_rows.view(torch.bfloat16), kv_rows.view(torch.float32)
    out = out if out is not None else torch.empty(B, H, LATENT_DIM, dtype=q.dtype, device=q.device)
    opart, lse = split_outputs(out, num_splits)
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
    combine_splits(opart, lse, out, num_splits)
    return out


def check_inputs(q: torch.Tensor, q_rope: torch.Tensor, kv_rows: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:  # fmt: skip
    """What every FP8-row decode kernel reads: a 512 + 64-dim query, [slots, 656] uint8 rows, a [B, pages] table."""
    B, H, D = q.shape
    if D != LATENT_DIM or q_rope.shape != (B, H, ROPE_DIM):
        raise ValueError(f"FP8 MLA decode expects 512 + 64-dim q, got {tuple(q.shape)}, {tuple(q_rope.shape)}")
    if kv_rows.dtype != torch.uint8 or kv_rows.dim() != 2 or kv_rows.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"FP8 MLA decode expects [slots, {FP8_ROW_BYTES}] uint8 rows, got {kv_rows.dtype} "
                         f"{tuple(kv_rows.shape)}")  # fmt: skip
    if page_table.dim() != 2 or page_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("page_table must be [B, max_pages] and seq_lens [B]")
    if q.stride(-1) != 1 or q_rope.stride(-1) != 1 or kv_rows.stride(-1) != 1:
        raise ValueError("q, q_rope and kv_rows need a contiguous last dimension")


def dequantize_rows(kv_rows: torch.Tensor) -> torch.Tensor:
    """[slots, 656] FP8 row bytes -> [slots, 576] float32 values (c_kv codes * scale, then k_pe)."""
    codes = kv_rows[:, :LATENT_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = kv_rows[:, FP8_SCALE_OFFSET : FP8_SCALE_OFFSET + 4].contiguous().view(torch.float32)
    rope = kv_rows[:, LATENT_DIM:FP8_SCALE_OFFSET].contiguous().view(torch.bfloat16).float()
    return torch.cat([codes * scale, rope], dim=-1)


def round_query_fp8(q: torch.Tensor) -> torch.Tensor:
    """The FP8-dot kernels' latent query as float32: each head row scaled to an amax of 448, rounded to e4m3
    and scaled back."""
    lat = q.float()
    amax = lat.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    return (lat * (FP8_MAX / amax)).to(torch.float8_e4m3fn).float() * (amax / FP8_MAX)


def mla_decode_fp8_reference(
    q: torch.Tensor, q_rope: torch.Tensor, kv_rows: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    """The kernel's math in float32 torch but for the FP8 rounding of the probabilities: q quantized per head
    row as the kernel does, attention over the dequantized rows -> [B, H, 512] float32."""
    full = torch.cat([round_query_fp8(q), q_rope.to(torch.bfloat16).float()], dim=-1)
    return mla_decode_reference(full, dequantize_rows(kv_rows), page_table, seq_lens, page_size, sm_scale)
