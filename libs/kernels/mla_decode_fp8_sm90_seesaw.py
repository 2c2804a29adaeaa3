"""Hopper (SM90) MLA decode over FP8 "token" rows, warp-specialized (FlashMLA's "seesaw" schedule) in Gluon: two
consumer warpgroups take turns at the tiles and a one-warp producer brings each page by TMA. The math, grid,
splits and combine are mla_decode_fp8_sm90's (its "fp8" dots); this is another schedule of the same sums.

- The tile's owner (warpgroup t % 2) runs its whole QK (64 x 64: the row reductions stay in its warps), then the
  softmax, writing the FP8 probabilities and the row statistics (the accumulator's rescale, m, l and the unit)
  next to the tile, and transposes the tile's codes in place (QK has read them) into PV's K-major operand.
- Each warpgroup holds half of the 64 x 512 output (128 fp32 registers a thread) and runs PV on its half for
  every tile, its own and the other's, in order; the running max and unit pass from one tile's owner to the
  next through those statistics, so both halves always agree on the scale.
- While one warpgroup is in its softmax, the other's QK and PVs keep the tensor cores busy; a slot goes back to
  the producer once both warpgroups' PVs on it are done."""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from libs.kernels import mla_decode_fp8_sm90 as sm90
from libs.kernels.mla_decode import combine_splits

STAGES = 4  # tiles in flight: 46 KB each (codes, k_pe, scales, probabilities, statistics) beside the 40 KB query
FP8_MAX = sm90.FP8_MAX


@gluon.jit
def _producer(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, full, empty, PT, SEQ, stride_ptb,
              stride_ptp, NUM_SPLITS, NUM_STAGES: gl.constexpr):  # fmt: skip
    """One warp: each tile's page into ring slot t % NUM_STAGES once both warpgroups are done with the tile
    NUM_STAGES before it (each page number read a tile ahead)."""
    split = gl.program_id(1)
    b = gl.program_id(2)
    start, end, n_tiles = sm90._split_range(SEQ, b, split, NUM_SPLITS)
    pt_row = b.to(gl.int64) * stride_ptb
    first_page = start // 64
    page = sm90._page(PT, pt_row, first_page, 0, n_tiles, stride_ptp)
    for t in range(n_tiles):
        # a fresh mbarrier counts as having completed the phase before its first, so the first round passes
        mbarrier.wait(empty.index(t % NUM_STAGES), ((t // NUM_STAGES) & 1) ^ 1)
        page = sm90._refill(lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, full, page, t, n_tiles, PT,
                            pt_row, first_page, stride_ptp, NUM_STAGES)  # fmt: skip


@gluon.jit
def _put_stats(st_smem, slot, rescale, m_i, l_i, unit):
    """The statistics after a tile, for the other warpgroup: its accumulator's rescale, m, l, unit (per row)."""
    st_smem.index(slot * 4).store(rescale)
    st_smem.index(slot * 4 + 1).store(m_i)
    st_smem.index(slot * 4 + 2).store(l_i)
    st_smem.index(slot * 4 + 3).store(unit)


@gluon.jit
def _get_stats(st_smem, slot, row_s: gl.constexpr):
    return (st_smem.index(slot * 4).load(row_s), st_smem.index(slot * 4 + 1).load(row_s),
            st_smem.index(slot * 4 + 2).load(row_s), st_smem.index(slot * 4 + 3).load(row_s))  # fmt: skip


@gluon.jit
def _softmax(s, k_scale, k_max, m_i, l_i, unit):
    """mla_decode_fp8_sm90's online-softmax step over its _logits with every statistic per row (the unit too, equal
    in every row) -> (FP8 probabilities times the rows' scales in the new unit, the accumulator's rescale, m, l,
    unit)."""
    m_new = gl.maximum(m_i, gl.reduce(s, 1, sm90._max))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no row yet: exp2(-inf - -inf) would be NaN
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.reduce(p, 1, sm90._add)
    new_unit = gl.maximum(unit, k_max / FP8_MAX)  # never shrinks: p8 <= 448, rescale <= 1
    p8 = (p * k_scale[None, :] * (1.0 / new_unit)[:, None]).to(gl.float8e4nv)
    return p8, alpha * (unit / new_unit), m_new, l_new, new_unit


@gluon.jit
def _pv(p_smem, vt_all, slot, o, W: gl.constexpr):
    """Start this warpgroup's PV for the slot's tile: its 256 output columns."""
    return warpgroup_mma(p_smem.index(slot), vt_all.index(slot).slice(W * 256, 256, 0).permute((1, 0)), o,
                         is_async=True)  # fmt: skip


@gluon.jit
def _own_tile(s, r, o_acc, t, q_scale, m_i, l_i, unit, k_smem, ks_smem, p_smem, st_smem, vt_all, empty, ready, start,
              end, sm_scale_log2, W: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
    """This warpgroup's tile t from its QK (s, r): the softmax, P and the statistics for both warpgroups, the codes
    transposed in place, then (once the previous PV is done) this half's PV started -> (o_acc, m, l, unit)."""
    s_layout: gl.constexpr = s.type.layout
    t_read: gl.constexpr = gl.BlockedLayout([8, 4], [2, 16], [4, 1], [1, 0])
    slot = t % NUM_STAGES
    k_scale, k_max = sm90._row_scales(ks_smem, slot, start + t * 64, end, s_layout, 4)
    cols = start + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
    s = sm90._logits(s, r, q_scale, k_scale, cols < end, sm_scale_log2, s_layout)
    rows = start + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, t_read))
    sm90._transpose(k_smem, slot, vt_all.index(slot), rows < end, t_read, IN_PLACE=True)  # QK has read them
    p8, rescale, m_i, l_i, unit = _softmax(s, k_scale, k_max, m_i, l_i, unit)
    p_smem.index(slot).store(p8)
    _put_stats(st_smem, slot, rescale, m_i, l_i, unit)
    fence_async_shared()  # the probabilities and the transposed codes, for both warpgroups' WGMMAs
    gl.thread_barrier()
    mbarrier.arrive(ready.index(slot))
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,))
    mbarrier.arrive(empty.index((t + NUM_STAGES - 1) % NUM_STAGES), pred=t > 0)  # this half's PV(t - 1)
    row_o: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    return _pv(p_smem, vt_all, slot, o * gl.convert_layout(rescale, row_o)[:, None], W), m_i, l_i, unit


@gluon.jit
def _other_tile(o_acc, s_acc, r_acc, t, p_smem, st_smem, vt_all, empty, ready, row_s: gl.constexpr, W: gl.constexpr,
                NUM_STAGES: gl.constexpr):  # fmt: skip
    """The other warpgroup's tile t on this half, once its owner has published it: the statistics after t, then
    (every WGMMA of this warpgroup done: the previous PV and the QK in s_acc, r_acc) the rescale and this half's
    PV started -> (o_acc, the QK's s and r, m, l, unit)."""
    slot = t % NUM_STAGES
    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)
    rescale, m_i, l_i, unit = _get_stats(st_smem, slot, row_s)
    s, r, o = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, r_acc, o_acc))
    mbarrier.arrive(empty.index((t + NUM_STAGES - 1) % NUM_STAGES), pred=t > 0)  # this half's PV(t - 1)
    row_o: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    return _pv(p_smem, vt_all, slot, o * gl.convert_layout(rescale, row_o)[:, None], W), s, r, m_i, l_i, unit


@gluon.jit
def _consumer(W: gl.constexpr, q8_smem, qr_smem, qs_smem, k_smem, kr_smem, ks_smem, p_smem, st_smem, full, empty,
              ready, SEQ, O, OPART, LSE, sm_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
              stride_lb, stride_lh, NUM_SPLITS, DIRECT_OUT: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
    """Warpgroup W: the softmax of tiles W, W + 2, ... and PV on output columns [256 W, 256 W + 256) of all."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    t_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)

    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    start, end, n_tiles = sm90._split_range(SEQ, b, split, NUM_SPLITS)
    vt_all = k_smem._reinterpret(gl.float8e4nv, [NUM_STAGES, 512, 64], t_sl)  # a slot's codes, once transposed
    q_scale = qs_smem.load(row_s)
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    r_zero = gl.zeros([64, 64], gl.float32, layout=r_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([64], gl.float32, layout=row_s)
    unit = gl.full([64], 1e-30, gl.float32, layout=row_s)
    o = gl.zeros([64, 256], gl.float32, layout=o_layout)  # sum of p * v in `unit`s, this warpgroup's columns

    # No WGMMA result crosses a branch or the loop's back edge in flight but the output's (ptxas serializes every
    # WGMMA of a kernel when one does, or when a register of one in flight is read).
    o_acc = warpgroup_mma_init(o)
    if W == 0:  # noqa: SIM102 - a compile-time branch around a run-time one
        if n_tiles > 0:  # tile 0: no tile before it
            mbarrier.wait(full.index(0), 0)
            s_acc, r_acc = sm90._issue_qk(q8_smem, qr_smem, k_smem, kr_smem, 0, s_zero, r_zero)
            s, r = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, r_acc))
            o_acc, m_i, l_i, unit = _own_tile(s, r, o_acc, 0, q_scale, m_i, l_i, unit, k_smem, ks_smem, p_smem,
                                              st_smem, vt_all, empty, ready, start, end, sm_scale_log2, W,
                                              NUM_STAGES)  # fmt: skip
            o_acc = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,)))
    # own tile t, after the other's tile t - 1: t's QK runs while the other warpgroup's softmax of t - 1 does,
    # this warpgroup's softmax of t while its PV of t - 1 does
    for t in range(2 - W, n_tiles, 2):
        mbarrier.wait(full.index(t % NUM_STAGES), (t // NUM_STAGES) & 1)
        s_acc, r_acc = sm90._issue_qk(q8_smem, qr_smem, k_smem, kr_smem, t % NUM_STAGES, s_zero, r_zero)
        o_acc, s, r, m_i, l_i, unit = _other_tile(o_acc, s_acc, r_acc, t - 1, p_smem, st_smem, vt_all, empty, ready,
                                                  row_s, W, NUM_STAGES)  # fmt: skip
        o_acc, m_i, l_i, unit = _own_tile(s, r, o_acc, t, q_scale, m_i, l_i, unit, k_smem, ks_smem, p_smem, st_smem,
                                          vt_all, empty, ready, start, end, sm_scale_log2, W, NUM_STAGES)  # fmt: skip
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,))
    if (n_tiles > 0) & ((n_tiles - W) % 2 == 0):  # the last tile is the other's
        o_acc, s, r, m_i, l_i, unit = _other_tile(warpgroup_mma_init(o), warpgroup_mma_init(s_zero),
                                                  warpgroup_mma_init(r_zero), n_tiles - 1, p_smem, st_smem, vt_all,
                                                  empty, ready, row_s, W, NUM_STAGES)  # fmt: skip
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,))

    l_o = gl.convert_layout(l_i, row_o)
    has = l_o > 0
    out = gl.where(has[:, None], o * (gl.convert_layout(unit, row_o) / gl.where(has, l_o, 1.0))[:, None], 0.0)
    offs_h = hb * 64 + gl.arange(0, 64, layout=row_o)
    offs_d = W * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
    if DIRECT_OUT:
        gl.store(O + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty))
    else:
        p_ptrs = OPART + b * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        gl.store(p_ptrs, out)
        if W == 0:
            has_s = l_i > 0
            lse = gl.where(has_s, m_i + gl.log2(gl.where(has_s, l_i, 1.0)), float("-inf"))
            gl.store(LSE + b * stride_lb + (hb * 64 + gl.arange(0, 64, layout=row_s)) * stride_lh + split, lse)


@gluon.jit
def _mla_fp8_seesaw_kernel(
    lat_desc, rope_desc, scale_desc, QL, QR, PT, SEQ, O, OPART, LSE, sm_scale_log2,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_ptb, stride_ptp,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_SPLITS, DIRECT_OUT: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    t_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    q8_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, 128], lat_desc.layout)  # as the codes' tiles
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], rope_desc.layout)
    qs_smem = gl.allocate_shared_memory(gl.float32, [64], flat)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES * 4, 64, 128], lat_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, 64], rope_desc.layout)
    ks_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 64, 4], scale_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 64], t_sl)
    st_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * 4, 64], flat)  # 4 rows a slot: _put_stats
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(st), count=1)  # the producer's expect + the TMA bytes
        mbarrier.init(empty.index(st), count=2)  # both warpgroups' PVs on the slot's tile
        mbarrier.init(ready.index(st), count=1)  # the owner's probabilities, statistics and transposed codes

    hb = gl.program_id(0)
    b = gl.program_id(2)
    q_scale = sm90._quantize_query(QL, QR, b, hb, stride_qb, stride_qh, stride_rb, stride_rh, q8_smem, qr_smem,
                                   q_load)  # fmt: skip
    qs_smem.store(q_scale)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize(
        [
            (_consumer, (0, q8_smem, qr_smem, qs_smem, k_smem, kr_smem, ks_smem, p_smem, st_smem, full, empty, ready,
                          SEQ, O, OPART, LSE, sm_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                          stride_lb, stride_lh, NUM_SPLITS, DIRECT_OUT, NUM_STAGES)),
            (_consumer, (1, q8_smem, qr_smem, qs_smem, k_smem, kr_smem, ks_smem, p_smem, st_smem, full, empty, ready,
                          SEQ, O, OPART, LSE, sm_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                          stride_lb, stride_lh, NUM_SPLITS, DIRECT_OUT, NUM_STAGES)),
            (_producer, (lat_desc, rope_desc, scale_desc, k_smem, kr_smem, ks_smem, full, empty, PT, SEQ, stride_ptb,
                         stride_ptp, NUM_SPLITS, NUM_STAGES)),
        ],
        [4, 1],
        [240, 24],
    )  # fmt: skip
    for st in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(st))
        mbarrier.invalidate(empty.index(st))
        mbarrier.invalidate(ready.index(st))


def chosen() -> bool:
    """MOEMESH_MLA_FP8=seesaw: the Engine runs this schedule where the SM90 kernel runs (sm90.available)."""
    return os.environ.get("MOEMESH_MLA_FP8", "auto") == "seesaw"


def mla_decode_fp8_sm90_seesaw(
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
    """mla_decode_fp8_sm90's contract (64-row pages, heads in 64s) with the seesaw schedule."""
    args, grid, (opart, lse, out) = sm90.launch_args(q, kv_rows, page_table, seq_lens, page_size, sm_scale, q_rope,
                                                     num_splits, out)  # fmt: skip
    _mla_fp8_seesaw_kernel[grid](*args, DIRECT_OUT=num_splits == 1, NUM_STAGES=STAGES, num_warps=4, maxnreg=168)
    combine_splits(opart, lse, out, num_splits)
    return out
