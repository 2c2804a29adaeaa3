"""Hopper (SM90) MLA decode over FP8 "token" rows (libs/engine/kv_fp8.Fp8Rows(512, 64), 656 bytes) in Gluon: QK
and PV on FP8 tensor cores (asynchronous WGMMA from shared memory), each page's rows brought by TMA into a
ring of NUM_STAGES tiles. mla_decode_fp8's math (its "fp8" dots), grid, splits and combine; that Triton kernel
stays the interpreter-testable reference. Gluon does not run under the interpreter: CPU tests check it
compiles for sm_90, GPU tests check the numbers."""

# (Reductions through gl.reduce with Gluon combine functions: gl.max and gl.sum are Triton functions, which
# the CPU tests' interpreter mode would hand the Gluon compiler as interpreted ones.)
# One program: 64 heads of one sequence (one 64-row WGMMA; the 512-wide output accumulator split between two
# warpgroups, 128 fp32 registers a thread) over one split of its pages, one 64-row page per tile:
# - QK: the latent query quantized per head row (amax to 448) once into shared memory, times the tile's codes
#   in four 128-deep FP8 WGMMAs, scaled by q_scale[h] * k_scale[n]; the bf16 rope part one more WGMMA.
# - PV: an 8-bit WGMMA reads both operands K-major, and the rows hold V with the latent dimension contiguous, so
#   while QK runs the tile's codes are copied transposed into a [512, 64] buffer (rows past the sequence's end
#   zeroed: a stale page may hold NaN codes, and 0 * NaN is NaN). The probabilities times each row's scale go
#   to FP8 in units of the largest row scale seen so far (mla_decode_fp8's scheme), through shared memory.
# - Tile j's QK is issued before tile j - 1's PV, so j's softmax runs while that PV does (the transposed tile
#   and the probabilities double-buffered). ptxas keeps these WGMMAs asynchronous (tests check its C7514
#   warning is absent); a variant that carried the PV in flight across the loop's back edge was serialized.

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from libs.kernels import mla_decode_fp8 as fp8_rows
from libs.kernels.fused import FP8_SCALE_OFFSET
from libs.kernels.mla_decode import LATENT_DIM, ROPE_DIM, combine_splits, split_outputs
from libs.kernels.mla_decode_fp8 import check_inputs

BLOCK_H = 64  # heads a program: one 64-row WGMMA
PAGE = 64  # rows a tile: one page (the only page size this kernel reads)
CHUNK = 128  # latent columns a TMA box and a QK WGMMA take (a 128-byte swizzled row)
FP8_MAX = gl.constexpr(fp8_rows.FP8_MAX)
STAGES = 2  # tiles in flight (41 KB each beside the query's 40 KB and the doubled transposed tile and P, 72 KB)


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _split_range(SEQ, b, split, NUM_SPLITS):
    """Sequence b's rows in this split (64-row aligned): (start, end, number of 64-row tiles)."""
    seq_len = gl.load(SEQ + b)
    split_len = gl.cdiv(gl.cdiv(seq_len, NUM_SPLITS), 64) * 64
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    return start, end, gl.cdiv(gl.maximum(end - start, 0), 64)


@gluon.jit
def _quantize_query(QL, QR, b, hb, stride_qb, stride_qh, stride_rb, stride_rh, q8_smem, qr_smem,
                    q_load: gl.constexpr):  # fmt: skip
    """The 64 heads' latent query quantized per head row (amax to 448) into q8_smem's four 128-column tiles, the
    rope query as it is into qr_smem -> the rows' scales (amax / 448) along q_load's rows."""
    offs_qh = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, q_load))
    offs_qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_load))
    q_ptrs = QL + b * stride_qb + offs_qh[:, None] * stride_qh + offs_qd[None, :]
    amax = gl.full([64], 1e-30, gl.float32, layout=gl.SliceLayout(1, q_load))
    for c in gl.static_range(4):
        amax = gl.maximum(amax, gl.reduce(gl.abs(gl.load(q_ptrs + c * 128).to(gl.float32)), 1, _max))
    for c in gl.static_range(4):
        x = gl.load(q_ptrs + c * 128).to(gl.float32) * (FP8_MAX / amax)[:, None]
        q8_smem.index(c).store(x.to(gl.float8e4nv))
    offs_qr = gl.arange(0, 64, layout=gl.SliceLayout(0, q_load))
    qr = gl.load(QR + b * stride_rb + offs_qh[:, None] * stride_rh + offs_qr[None, :])
    qr_smem.store(qr.to(gl.bfloat16))
    return amax / FP8_MAX


@gluon.jit
def _load_tile(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, bars, page, i, n_tiles,
               NUM_STAGES: gl.constexpr):  # fmt: skip
    """TMA of tile i's page (four latent boxes, the rope box and the scales' 16 bytes a row) into ring slot
    i % NUM_STAGES, skipped past the last tile."""
    stage = i % NUM_STAGES
    pred = i < n_tiles
    row = page * 64
    bar = bars.index(stage)
    nbytes: gl.constexpr = 4 * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes + scale_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    for c in gl.static_range(4):
        tma.async_copy_global_to_shared(lat_desc, [row, c * 128], bar, k_smem.index(stage * 4 + c), pred)
    tma.async_copy_global_to_shared(rope_desc, [row, 0], bar, kr_smem.index(stage), pred)
    tma.async_copy_global_to_shared(scale_desc, [row, 0], bar, ks_smem.index(stage), pred)


@gluon.jit
def _refill(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, bars, page, t, n_tiles, PT, pt_row,
            first_page, stride_ptp, NUM_STAGES: gl.constexpr):  # fmt: skip
    """Tile t's TMA (its page number loaded a refill earlier) -> tile t + 1's page number, for the next refill."""
    _load_tile(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, bars, page, t, n_tiles, NUM_STAGES)
    return _page(PT, pt_row, first_page, t + 1, n_tiles, stride_ptp)


@gluon.jit
def _page(PT, pt_row, first_page, i, n_tiles, stride_ptp):
    """Tile i's page number (0 past the last tile)."""
    return gl.load(PT + pt_row + (first_page + i) * stride_ptp, mask=i < n_tiles, other=0)


@gluon.jit
def _issue_qk(q8_smem, qr_smem, k_smem, kr_smem, stage, s_zero, r_zero):
    """Start (asynchronously) the slot's QK: four 128-deep FP8 products over the codes, one bf16 over k_pe."""
    s_acc = warpgroup_mma(q8_smem.index(0), k_smem.index(stage * 4).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)  # fmt: skip
    for c in gl.static_range(1, 4):
        s_acc = warpgroup_mma(q8_smem.index(c), k_smem.index(stage * 4 + c).permute((1, 0)), s_acc, is_async=True)
    r_acc = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), r_zero, use_acc=False, is_async=True)
    return s_acc, r_acc


@gluon.jit
def _transpose(k_smem, stage, vt, ok_t, t_read: gl.constexpr, IN_PLACE: gl.constexpr = False):
    """The slot's codes [64 rows, 512] into vt [512, 64] (PV's K-major operand), chunk by chunk, rows where not
    ok_t zeroed (a stale page may hold NaN codes: 0 * NaN). IN_PLACE: vt is the slot's own bytes (each
    128-column chunk's 8 KB hold its 128 rows of vt), so every warp has read a chunk before it is overwritten."""
    for c in gl.static_range(4):
        codes = k_smem.index(stage * 4 + c).load(t_read).to(gl.int8, bitcast=True)
        codes = gl.where(ok_t[:, None], codes, 0)
        if IN_PLACE:
            gl.thread_barrier()
        vt.slice(c * 128, 128, 0).store(gl.permute(codes, (1, 0)).to(gl.float8e4nv, bitcast=True))


@gluon.jit
def _row_scales(ks_smem, stage, row0, end, s_layout: gl.constexpr, WARPS: gl.constexpr):
    """The slot's per-row scales (the first float of each row's 16 TMA'd bytes; 0 past the sequence's end, whose
    stale bytes may hold any scale) along S's columns, and their largest. Every warp reads all 64 (256 bytes), so
    the largest and the move to S's columns stay within a warp."""
    ks_layout: gl.constexpr = gl.BlockedLayout([2, 4], [32, 1], [1, WARPS], [1, 0])
    raw = ks_smem.index(stage).load(ks_layout)
    first = gl.arange(0, 4, layout=gl.SliceLayout(0, ks_layout)) == 0
    ok = (row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ks_layout))) < end
    scale = gl.reduce(gl.where(first[None, :] & ok[:, None], raw, 0.0), 1, _add)
    return gl.convert_layout(scale, gl.SliceLayout(0, s_layout)), gl.reduce(scale, 0, _max)


@gluon.jit
def _logits(s, r, q_scale, k_scale, mask_n, sm_scale_log2, s_layout: gl.constexpr):
    """A tile's scores in log2 units from its FP8 product s (scaled by the query's and the rows' scales) and its
    rope product r; -inf past the sequence's end."""
    s = s * (q_scale[:, None] * k_scale[None, :]) + gl.convert_layout(r, s_layout)
    return gl.where(mask_n[None, :], s * sm_scale_log2, float("-inf"))


@gluon.jit
def _row_halves(x):
    """[64, 64] in S's layout -> the sums of each row's two 32-column halves [64, 2], the halves the two
    warpgroups hold (so no exchange between them)."""
    return gl.reduce(gl.reshape(x, [64, 2, 32]), 2, _add)


@gluon.jit
def _softmax(s, r, q_scale, k_scale, k_max, mask_n, m_i, l_i, unit, sm_scale_log2, s_layout: gl.constexpr):
    """One tile's online-softmax step -> (FP8 probabilities times the rows' scales in the new unit, the
    accumulator's rescale, m, l (per row half: _row_halves), unit). A tile with no row (past the end) changes
    nothing."""
    s = _logits(s, r, q_scale, k_scale, mask_n, sm_scale_log2, s_layout)
    m_new = gl.maximum(m_i, gl.reduce(s, 1, _max))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no row yet: exp2(-inf - -inf) would be NaN
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    p_sum = _row_halves(p)
    l_new = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, p_sum.type.layout), assert_trivial=True)[:, None] + p_sum
    new_unit = gl.maximum(unit, k_max / FP8_MAX)  # never shrinks: p8 <= 448, rescale <= 1
    p8 = (p * (k_scale / new_unit)[None, :]).to(gl.float8e4nv)
    return p8, alpha * (unit / new_unit), m_new, l_new, new_unit


@gluon.jit
def _mla_fp8_sm90_kernel(
    lat_desc, rope_desc, scale_desc, QL, QR, PT, SEQ, O, OPART, LSE, sm_scale_log2,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_ptb, stride_ptp,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_SPLITS, DIRECT_OUT: gl.constexpr, NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 32])
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    # query loads: 8 contiguous bf16 a thread; the transpose: 8 rows x 4 bytes a thread, read by ldmatrix and
    # stored in the permuted layout as it is (8 bytes along the rows), with no layout conversion between
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    t_read: gl.constexpr = gl.BlockedLayout([8, 4], [2, 16], [4, 2], [1, 0])
    t_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)

    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    start, end, n_tiles = _split_range(SEQ, b, split, NUM_SPLITS)
    pt_row = b.to(gl.int64) * stride_ptb
    first_page = start // 64

    q8_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, 128], lat_desc.layout)  # as the codes' tiles
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], rope_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES * 4, 64, 128], lat_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, 64], rope_desc.layout)
    ks_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 64, 4], scale_desc.layout)
    vt_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 512, 64], t_sl)  # two: one being read by PV
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64], t_sl)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(st), count=1)
    for st in gl.static_range(NUM_STAGES):
        page = _page(PT, pt_row, first_page, st, n_tiles, stride_ptp)
        _load_tile(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, bars, page, st, n_tiles, NUM_STAGES)
    next_page = _page(PT, pt_row, first_page, NUM_STAGES, n_tiles, stride_ptp)  # one refill ahead

    q_scale = gl.convert_layout(_quantize_query(QL, QR, b, hb, stride_qb, stride_qh, stride_rb, stride_rh, q8_smem,
                                                qr_smem, q_load), row_s)  # fmt: skip
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    l_i = _row_halves(s_zero)
    r_zero = gl.zeros([64, 64], gl.float32, layout=r_layout)
    unit = sm_scale_log2 * 0.0 + 1e-30
    rows_t = gl.arange(0, 64, layout=gl.SliceLayout(1, t_read))
    cols_s = gl.arange(0, 64, layout=col_s)
    # tile j's QK is issued before tile j - 1's PV, so j's softmax runs while that PV does; tile 0's QK and
    # softmax come first, and the last iteration's "next" tile is past the end (no load, no change)
    mbarrier.wait(bars.index(0), 0, pred=n_tiles > 0)
    s_acc, r_acc = _issue_qk(q8_smem, qr_smem, k_smem, kr_smem, 0, s_zero, r_zero)
    _transpose(k_smem, 0, vt_smem.index(0), (start + rows_t) < end, t_read)
    s, r = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, r_acc))
    k_scale, k_max = _row_scales(ks_smem, 0, start, end, s_layout, 8)
    gl.thread_barrier()
    next_page = _refill(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, bars, next_page, NUM_STAGES,
                        n_tiles, PT, pt_row, first_page, stride_ptp, NUM_STAGES)  # fmt: skip
    p8, rescale, m_i, l_i, unit = _softmax(s, r, q_scale, k_scale, k_max, (start + cols_s) < end, m_i, l_i, unit,
                                           sm_scale_log2, s_layout)  # fmt: skip
    p_smem.index(0).store(p8)
    o = gl.zeros([64, 512], gl.float32, layout=o_layout)  # sum of p * v in `unit`s
    fence_async_shared()
    gl.thread_barrier()
    for i in range(0, n_tiles):
        j = i + 1
        stage = j % NUM_STAGES
        buf = i % 2
        mbarrier.wait(bars.index(stage), (j // NUM_STAGES) & 1, pred=j < n_tiles)
        s_acc, r_acc = _issue_qk(q8_smem, qr_smem, k_smem, kr_smem, stage, s_zero, r_zero)
        o_acc = warpgroup_mma(p_smem.index(buf), vt_smem.index(buf).permute((1, 0)),
                              o, is_async=True)  # fmt: skip
        # into the other buffers: their last reader, tile i - 1's PV, was waited for by both warpgroups
        _transpose(k_smem, stage, vt_smem.index(1 - buf), (start + j * 64 + rows_t) < end,
                   t_read)  # fmt: skip
        s, r = warpgroup_mma_wait(num_outstanding=1, deps=(s_acc, r_acc))  # QK done, PV may still run
        k_scale, k_max = _row_scales(ks_smem, stage, start + j * 64, end, s_layout, 8)
        gl.thread_barrier()  # every warp is done with this slot (its MMAs, transposes and scales)
        next_page = _refill(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, bars, next_page,
                            j + NUM_STAGES, n_tiles, PT, pt_row, first_page, stride_ptp, NUM_STAGES)  # fmt: skip
        p8, rescale, m_i, l_i, unit = _softmax(s, r, q_scale, k_scale, k_max, (start + j * 64 + cols_s) < end, m_i, l_i,
                                               unit, sm_scale_log2, s_layout)  # fmt: skip
        p_smem.index(1 - buf).store(p8)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,))
        o = o * gl.convert_layout(rescale, row_o)[:, None]
        fence_async_shared()
        gl.thread_barrier()
    for st in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(st))

    l_i = gl.convert_layout(gl.reduce(l_i, 1, _add), row_s)
    l_o = gl.convert_layout(l_i, row_o)
    has = l_o > 0
    out = o * (unit / gl.where(has, l_o, 1.0))[:, None]
    offs_h = hb * 64 + gl.arange(0, 64, layout=row_o)
    offs_d = gl.arange(0, 512, layout=col_o)
    if DIRECT_OUT:
        gl.store(O + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty))
    else:
        p_ptrs = OPART + b * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        gl.store(p_ptrs, out)
        has_s = l_i > 0
        lse = gl.where(has_s, m_i + gl.log2(gl.where(has_s, l_i, 1.0)), float("-inf"))
        gl.store(LSE + b * stride_lb + (hb * 64 + gl.arange(0, 64, layout=row_s)) * stride_lh + split, lse)


def lat_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


def rope_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def scale_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def descriptors(kv_rows: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the rows' parts a 64-row page at a time: the codes in 128-byte boxes, k_pe (bf16), and
    each row's scale with the 12 bytes after it (a TMA box is 16 bytes wide at least)."""
    lat = kv_rows.view(torch.float8_e4m3fn)[:, :LATENT_DIM]
    rope = kv_rows.view(torch.bfloat16)[:, LATENT_DIM // 2 : LATENT_DIM // 2 + ROPE_DIM]
    scales = kv_rows.view(torch.float32)[:, FP8_SCALE_OFFSET // 4 : FP8_SCALE_OFFSET // 4 + 4]
    return (TensorDescriptor.from_tensor(lat, [PAGE, CHUNK], lat_layout()),
            TensorDescriptor.from_tensor(rope, [PAGE, ROPE_DIM], rope_layout()),
            TensorDescriptor.from_tensor(scales, [PAGE, 4], scale_layout()))  # fmt: skip


def available(device: torch.device, page_size: int, num_heads: int) -> bool:
    """SM90, 64-row pages and heads in 64s; off with MOEMESH_MLA_FP8=triton (the Triton kernel then runs)."""
    if device.type != "cuda" or os.environ.get("MOEMESH_MLA_FP8", "auto") == "triton":
        return False
    return page_size == PAGE and num_heads % BLOCK_H == 0 and torch.cuda.get_device_capability(device)[0] == 9


def launch_args(q: torch.Tensor, kv_rows: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                page_size: int, sm_scale: float, q_rope: torch.Tensor, num_splits: int,
                out: torch.Tensor | None) -> tuple[tuple, tuple[int, int, int], tuple[torch.Tensor, ...]]:  # fmt: skip
    """What the SM90 kernels (either schedule) read, checked -> (their arguments before the constexprs, the grid:
    64 heads x split x sequence, (the split outputs, their LSEs, out) for combine_splits)."""
    check_inputs(q, q_rope, kv_rows, page_table, seq_lens)
    B, H, _ = q.shape
    if page_size != PAGE or H % BLOCK_H:
        raise ValueError(f"the SM90 FP8 MLA decode takes {PAGE}-row pages and heads in {BLOCK_H}s, got "
                         f"page_size={page_size}, {H} heads")  # fmt: skip
    out = out if out is not None else torch.empty(B, H, LATENT_DIM, dtype=q.dtype, device=q.device)
    opart, lse = split_outputs(out, num_splits)
    args = (
        *descriptors(kv_rows), q, q_rope, page_table, seq_lens, out, opart, lse, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), page_table.stride(0), page_table.stride(1),
        out.stride(0), out.stride(1), opart.stride(0), opart.stride(1), opart.stride(2) if num_splits > 1 else 0,
        lse.stride(0), lse.stride(1), num_splits,
    )  # fmt: skip
    return args, (H // BLOCK_H, num_splits, B), (opart, lse, out)


def mla_decode_fp8_sm90(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    q_rope: torch.Tensor,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """mla_decode_fp8's contract ("fp8" dots): q [B, H, 512] and q_rope [B, H, 64] (any batch/head strides)
    over one layer's FP8 row bytes kv_rows [slots, 656] uint8 -> [B, H, 512] in q's dtype; page_size 64,
    H a multiple of 64."""
    args, grid, (opart, lse, out) = launch_args(q, kv_rows, page_table, seq_lens, page_size, sm_scale, q_rope,
                                                num_splits, out)  # fmt: skip
    _mla_fp8_sm90_kernel[grid](*args, DIRECT_OUT=num_splits == 1, NUM_STAGES=STAGES, num_warps=8)
    combine_splits(opart, lse, out, num_splits)
    return out
