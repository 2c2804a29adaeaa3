"""MLA decode attention (absorbed form) over the paged latent KV cache as a Triton split-K kernel: queries of
H heads x 576 (q_nope @ W_UK, then roped q_pe) against the cached latent rows -> [B, H, 512] in latent space
(the caller applies W_UV). The split count depends on the batch size only, so a captured graph stays valid."""

# Keys are the cached rows (c_kv then k_pe); values their first 512 values: one load feeds both products. The
# latent's 512 columns go as four 128-wide chunks with their own dots and accumulators (one [BLOCK_H, 512]
# tile in registers at a time spilled at 64 x 64 tiles).
# Flash-decoding: grid (head blocks, splits, sequences); each program walks its share of one context in
# BLOCK_N-row tiles through the page table with an online softmax, writing the output (one split) or a
# partial plus its log-sum-exp for `_mla_combine`. The cache may be bf16 or float8_e4m3fn with a per-tensor
# `kv_scale`, widened to bf16 in registers with the scale folded into the softmax scale and the output.

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LATENT_DIM = 512
ROPE_DIM = 64


@dataclass(frozen=True)
class MLAConfig:
    """Tile shape of the split kernel. Defaults: the best of a sweep for 128 heads (bench/kernels.py; the
    numbers: bench/NOTES-code-history.md)."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _mla_split_kernel(
    QL, QR, KV, PT, SEQ, O, OPART, LSE,
    sm_scale_log2, out_scale,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_kv, stride_ptb, stride_ptp, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_SPLITS, PAGE_SIZE: tl.constexpr, DIRECT_OUT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
):  # fmt: skip
    CH: tl.constexpr = D_LAT // 4  # the latent in four column chunks, each its own dots and accumulator
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
    dt = tl.float16 if KV.dtype.element_ty == tl.float8e4nv else QL.dtype.element_ty  # fp8 widens to fp16
    q0 = _lat_chunk(q_rows, 0, CH).to(dt)
    q1 = _lat_chunk(q_rows, 1, CH).to(dt)
    q2 = _lat_chunk(q_rows, 2, CH).to(dt)
    q3 = _lat_chunk(q_rows, 3, CH).to(dt)
    q_rope = tl.load(QR + b * stride_rb + offs_h[:, None] * stride_rh + offs_r[None, :]).to(dt)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, CH], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(PT + b * stride_ptb + (offs_n // PAGE_SIZE) * stride_ptp, mask=mask_n, other=0)
        row = KV + (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE)[:, None] * stride_kv
        k0 = tl.load(row + tl.arange(0, CH)[None, :], mask=mask_n[:, None], other=0.0).to(dt)
        k1 = tl.load(row + CH + tl.arange(0, CH)[None, :], mask=mask_n[:, None], other=0.0).to(dt)
        k2 = tl.load(row + 2 * CH + tl.arange(0, CH)[None, :], mask=mask_n[:, None], other=0.0).to(dt)
        k3 = tl.load(row + 3 * CH + tl.arange(0, CH)[None, :], mask=mask_n[:, None], other=0.0).to(dt)
        k_rope = tl.load(row + D_LAT + offs_r[None, :], mask=mask_n[:, None], other=0.0).to(dt)
        qk = tl.dot(q_rope, tl.trans(k_rope))
        qk = tl.dot(q0, tl.trans(k0), qk)
        qk = tl.dot(q1, tl.trans(k1), qk)
        qk = tl.dot(q2, tl.trans(k2), qk)
        qk = tl.dot(q3, tl.trans(k3), qk)
        qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(dt)
        acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(p, k3, acc3 * alpha[:, None])
        m_i = m_new

    has = l_i > 0
    scale = out_scale / tl.where(has, l_i, 1.0)
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


@triton.jit
def _lat_chunk(rows, c: tl.constexpr, CH: tl.constexpr):
    """Columns [c * CH, (c + 1) * CH) of each row that `rows` [BLOCK_H, 1] points at."""
    return tl.load(rows + c * CH + tl.arange(0, CH)[None, :])


@triton.jit
def _store_lat_chunk(ptr, acc, scale, c: tl.constexpr, CH: tl.constexpr):
    offs = c * CH + tl.arange(0, CH)
    tl.store(ptr + offs[None, :], (acc * scale[:, None]).to(ptr.dtype.element_ty))


@triton.jit
def _mla_combine_kernel(
    OPART, LSE, O,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_SPLITS, SPLITS_POW2: tl.constexpr, D_LAT: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, D_LAT)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)
    w = tl.where(mask_s, w, 0.0)
    w = w / tl.sum(w, 0)
    part = tl.load(
        OPART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


def choose_num_splits(batch: int, num_heads: int, max_ctx: int, cfg: MLAConfig, num_sms: int = 132) -> int:
    """Enough programs to fill the SMs about twice, but never a split shorter than four tiles."""
    programs = batch * triton.cdiv(num_heads, cfg.block_h)
    want = triton.cdiv(2 * num_sms, programs)
    most = max(1, max_ctx // (4 * cfg.block_n))
    return max(1, min(want, most, 64))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    num_splits: int = 1,
    kv_scale: float = 1.0,
    cfg: MLAConfig | None = None,
    out: torch.Tensor | None = None,
    q_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, 576] (or q [B, H, 512] + q_rope [B, H, 64], any strides) attends over
    kv_cache [slots, 576] (bf16, or float8_e4m3fn with `kv_scale`) through page_table [B, max_pages] int32
    (any strides) for seq_lens [B] int32 (>= 1) rows each -> [B, H, 512]."""
    cfg = cfg or MLAConfig()
    if q_rope is None:
        if q.shape[-1] != LATENT_DIM + ROPE_DIM:
            raise ValueError(f"MLA decode expects 576-dim q, got {tuple(q.shape)}")
        q, q_rope = q[..., :LATENT_DIM], q[..., LATENT_DIM:]
    B, H, D = q.shape
    if D != LATENT_DIM or q_rope.shape != (B, H, ROPE_DIM) or kv_cache.shape[-1] != LATENT_DIM + ROPE_DIM:
        raise ValueError(
            f"MLA decode expects 512 + 64-dim q and 576-dim cache rows, got {tuple(q.shape)}, "
            f"{tuple(q_rope.shape)}, cache {tuple(kv_cache.shape)}"
        )
    block_h = min(cfg.block_h, max(16, triton.next_power_of_2(H)))
    if H % block_h:
        raise ValueError(f"num_heads {H} must be a multiple of the head block {block_h}")
    if page_table.dim() != 2 or page_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("page_table must be [B, max_pages] and seq_lens [B]")
    if q.stride(-1) != 1 or q_rope.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last dimension")
    out = out if out is not None else torch.empty(B, H, LATENT_DIM, dtype=q.dtype, device=q.device)
    log2e = 1.4426950408889634
    scale_log2 = sm_scale * kv_scale * log2e
    opart, lse = split_outputs(out, num_splits)
    grid = (H // block_h, num_splits, B)
    _mla_split_kernel[grid](
        q, q_rope, kv_cache, page_table, seq_lens, out, opart, lse,
        scale_log2, kv_scale,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), kv_cache.stride(0), page_table.stride(0), page_table.stride(1), out.stride(0), out.stride(1),
        opart.stride(0), opart.stride(1), opart.stride(2) if num_splits > 1 else 0,
        lse.stride(0), lse.stride(1),
        num_splits, PAGE_SIZE=page_size, DIRECT_OUT=num_splits == 1, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        D_LAT=LATENT_DIM, D_ROPE=ROPE_DIM, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    combine_splits(opart, lse, out, num_splits)
    return out


def split_outputs(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K decode's float32 partial outputs [B, H, splits, 512] and log-sum-exps [B, H, splits] for
    output `out` [B, H, 512]; one split writes `out` directly (the two returned are `out`, unused)."""
    if num_splits == 1:
        return out, out
    B, H = out.shape[:2]
    opart = torch.empty(B, H, num_splits, LATENT_DIM, dtype=torch.float32, device=out.device)
    return opart, torch.empty(B, H, num_splits, dtype=torch.float32, device=out.device)


def combine_splits(opart: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """The splits' partials (split_outputs') into `out` by their log-sum-exps; nothing for one split."""
    if num_splits == 1:
        return
    B, H = out.shape[:2]
    _mla_combine_kernel[(H, B)](
        opart, lse, out,
        opart.stride(0), opart.stride(1), opart.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits), D_LAT=LATENT_DIM, num_warps=4,
    )  # fmt: skip


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch oracle (float32 math): gathers each sequence's rows and runs softmax attention."""
    B, H, _ = q.shape
    out = torch.empty(B, H, LATENT_DIM, dtype=q.dtype, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        pages = page_table[b, : triton.cdiv(n, page_size)].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=q.device)).reshape(-1)[:n]
        rows = kv_cache[slots].float() * kv_scale  # [n, 576]
        scores = (q[b].float() @ rows.T) * sm_scale  # [H, n]
        out[b] = (scores.softmax(-1) @ rows[:, :LATENT_DIM]).to(q.dtype)
    return out
