"""Hopper (SM90) FP8 block-scaled GEMM in Gluon, with fp8_gemm's math and layouts: TMA-fed shared-memory ring,
asynchronous WGMMA, the per-128-K scale promotion overlapped with the next block's MMA. The wrapper falls
back to the Triton kernel unless: SM90, rows per tile >= 64, K % 128 == 0, grouped N % BLOCK_N == 0."""

# Why: Triton's `acc += tl.dot(a, b) * scale` makes every 128-deep MMA wait for its own result before the fp32
# rescale, so the tensor cores idle once per K block. Here block kb+1's MMA is issued before block kb's
# partial is waited for and promoted (two accumulators in flight, DeepGEMM's scheme), operands arriving by
# TMA into NUM_BUFFERS stages, NUM_BUFFERS - 2 blocks ahead. Grouped weights are one [E * N, K] matrix. Gluon
# does not run under the interpreter: CPU tests check it compiles for sm_90, GPU tests check the numbers.

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

DENSE, MASKED, CONTIGUOUS = 0, 1, 2
BLOCK_K = 128


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:  # tile the [4, 1] WGMMA atom along M while rows remain
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n = 256
    while n > max(block_n // warps[1], 8) or block_n % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 32])


@gluon.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: gl.constexpr):
    """fp8_gemm.grouped_tile's program order (a Gluon kernel calls Gluon functions only)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@gluon.jit
def _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, i, a_row, b_row, kb0, n_kb, NUM_BUFFERS: gl.constexpr):
    """TMA of K block kb0 + i of the A and B tiles into ring slot i % NUM_BUFFERS (skipped past the end)."""
    slot = i % NUM_BUFFERS
    pred = i < n_kb
    bar = bars.index(slot)
    k = (kb0 + i) * 128
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, k], bar, a_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_bufs.index(slot), pred)


@gluon.jit
def _issue_mma(a_bufs, b_bufs, bars, i, regs, NUM_BUFFERS: gl.constexpr):
    """Wait for ring slot i's tiles, then start (asynchronously) the fresh product of K block i; `regs` is
    a dead tensor of the accumulator's shape whose registers the product may take (its value is unused)."""
    slot = i % NUM_BUFFERS
    mbarrier.wait(bars.index(slot), (i // NUM_BUFFERS) & 1)
    return warpgroup_mma(
        a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), regs, use_acc=False, is_async=True
    )


@gluon.jit
def _scale(as_ptr, bs_ptr, m_ok, n_ok, kb, stride_sk, stride_bsk, BLOCK_N: gl.constexpr):
    """The fp32 scale of K block kb's partial product: [BLOCK_M] per row when the tile's columns share one
    128-column weight scale (BLOCK_N <= 128; kept 1-D so it costs two registers, not a tile), else the
    [BLOCK_M, BLOCK_N] product of row and column scales."""
    a_s = gl.load(as_ptr + kb * stride_sk, mask=m_ok, other=0.0)
    if BLOCK_N <= 128:
        return a_s * gl.load(bs_ptr + kb * stride_bsk)
    else:
        b_s = gl.load(bs_ptr + kb * stride_bsk, mask=n_ok, other=0.0)
        return a_s[:, None] * b_s[None, :]


@gluon.jit
def _promote(acc, part, scale, BLOCK_N: gl.constexpr):
    if BLOCK_N <= 128:
        return acc + part * scale[:, None]
    else:
        return acc + part * scale


@gluon.jit
def _tile_origin(expert, off_m, off_n, N, K, a_rows_per_expert, LAYOUT: gl.constexpr, SPLIT_K: gl.constexpr):
    """TMA row of the tile's A rows (experts' row blocks stacked for MASKED) and of its weight rows (experts'
    [N, K] weights stacked), and the K blocks this program sums: all of them, or its slice under split-K
    (each slice's partial goes to its own fp32 plane of C, summed after)."""
    a_row = off_m
    if LAYOUT == 1:
        a_row = expert * a_rows_per_expert + off_m
    n_kb = gl.cdiv(K, 128)
    kb0 = 0
    if SPLIT_K > 1:
        per = gl.cdiv(n_kb, SPLIT_K)
        kb0 = gl.program_id(2) * per
        n_kb = gl.minimum(per, n_kb - kb0)
    return a_row, expert * N + off_n, kb0, n_kb


@gluon.jit
def _store_tile(c_ptr, acc, offs_m, offs_n, m_ok, N, expert, stride_ce, stride_cm, LAYOUT: gl.constexpr,
                SPLIT_K: gl.constexpr):  # fmt: skip
    c_row = offs_m.to(gl.int64) * stride_cm  # int64: [E, M_max, N] outputs can pass 2**31 elements
    if LAYOUT == 1:
        c_row += expert.to(gl.int64) * stride_ce
    c_ptrs = c_ptr + c_row[:, None] + offs_n[None, :]
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    if SPLIT_K > 1:  # dense only: stride_ce steps between the slices' planes
        gl.store(c_ptrs + gl.program_id(2).to(gl.int64) * stride_ce, acc, mask=mask)
    else:
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tile_two_halves(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, pid_m, pid_n, expert, rows, N, K, a_rows_per_expert,
    stride_ce, stride_cm, stride_se, stride_sm, stride_sk, stride_bse, stride_bsn, stride_bsk,
    LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUFFERS: gl.constexpr, SPLIT_K: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """A BLOCK_M x 256 output tile as two 128-column MMAs over one TMA'd 256-row weight tile: twice the
    FLOPs per byte brought from L2 of a 128-wide tile, while each MMA's partial product (and so the
    promotion's extra registers) stays 128 wide. Each half waits for its own MMA (no overlap)."""
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, 128, num_warps)
    row_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * 256
    a_row, b_row, kb0, n_kb = _tile_origin(expert, off_m, off_n, N, K, a_rows_per_expert, LAYOUT, SPLIT_K)
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=row_l)
    offs_n = off_n + gl.arange(0, 128, layout=col_l)
    m_ok = offs_m < rows
    as_base = as_ptr + expert * stride_se * (LAYOUT == 1) + offs_m * stride_sm
    last_nb = gl.cdiv(N, 128) - 1  # a half past N reads the last real scale; its columns are never stored
    bs0 = bs_ptr + expert * stride_bse + gl.minimum(off_n // 128, last_nb) * stride_bsn
    bs1 = bs_ptr + expert * stride_bse + gl.minimum(off_n // 128 + 1, last_nb) * stride_bsn

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(s), count=1)
    for pre in gl.static_range(NUM_BUFFERS - 2):
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, pre, a_row, b_row, kb0, n_kb, NUM_BUFFERS)
    acc0 = gl.zeros((BLOCK_M, 128), dtype=gl.float32, layout=mma_layout)
    acc1 = gl.zeros((BLOCK_M, 128), dtype=gl.float32, layout=mma_layout)
    spare = gl.zeros((BLOCK_M, 128), dtype=gl.float32, layout=mma_layout)
    for i in range(0, n_kb):
        kb = kb0 + i
        a_s = gl.load(as_base + kb * stride_sk, mask=m_ok, other=0.0)
        s0 = a_s * gl.load(bs0 + kb * stride_bsk)
        s1 = a_s * gl.load(bs1 + kb * stride_bsk)
        _issue_load(
            a_desc, b_desc, a_bufs, b_bufs, bars, i + NUM_BUFFERS - 2, a_row, b_row, kb0, n_kb, NUM_BUFFERS
        )
        slot = i % NUM_BUFFERS
        mbarrier.wait(bars.index(slot), (i // NUM_BUFFERS) & 1)
        a_t = a_bufs.index(slot)
        b_t = b_bufs.index(slot)
        part = warpgroup_mma(a_t, b_t.slice(0, 128, 0).permute((1, 0)), spare, use_acc=False, is_async=True)
        spare, acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(part, acc0))
        acc0 = acc0 + spare * s0[:, None]
        part = warpgroup_mma(a_t, b_t.slice(128, 128, 0).permute((1, 0)), spare, use_acc=False, is_async=True)
        spare, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(part, acc1))
        acc1 = acc1 + spare * s1[:, None]
    for s in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(s))
    _store_tile(c_ptr, acc0, offs_m, offs_n, m_ok, N, expert, stride_ce, stride_cm, LAYOUT, SPLIT_K)
    _store_tile(c_ptr, acc1, offs_m, offs_n + 128, m_ok, N, expert, stride_ce, stride_cm, LAYOUT, SPLIT_K)


@gluon.jit(do_not_specialize=["M", "a_rows_per_expert"])  # one compile for every M (fp8_gemm's body says why)
def _fp8_gemm_sm90_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, counts_ptr, tile_expert_ptr,
    M, N, K, a_rows_per_expert,
    stride_ce, stride_cm, stride_se, stride_sm, stride_sk, stride_bse, stride_bsn, stride_bsk,
    LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
    SPLIT_K: gl.constexpr, OVERLAP: gl.constexpr, UNROLL: gl.constexpr, GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _grouped_tile(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    expert = 0
    rows = M
    if LAYOUT == 1:
        expert = gl.program_id(1)
        rows = gl.load(counts_ptr + expert)
    if LAYOUT == 2:
        expert = gl.load(tile_expert_ptr + pid_m)
    active = (pid_m * BLOCK_M < rows) & (expert >= 0)
    if BLOCK_N == 256 and active:  # static on BLOCK_N: the other tile shape's code is never traced
        _tile_two_halves(
            a_desc, b_desc, c_ptr, as_ptr, bs_ptr, pid_m, pid_n, expert, rows, N, K, a_rows_per_expert,
            stride_ce, stride_cm, stride_se, stride_sm, stride_sk, stride_bse, stride_bsn, stride_bsk,
            LAYOUT, BLOCK_M, NUM_BUFFERS, SPLIT_K, num_warps,
        )  # fmt: skip
    elif BLOCK_N <= 128 and active:
        mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        a_row, b_row, kb0, n_kb = _tile_origin(expert, off_m, off_n, N, K, a_rows_per_expert, LAYOUT, SPLIT_K)

        offs_m = off_m + gl.arange(0, BLOCK_M, layout=row_l)
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=col_l)
        m_ok = offs_m < rows
        n_ok = offs_n < N
        s_row = expert * stride_se * (LAYOUT == 1) + offs_m * stride_sm
        as_base = as_ptr + s_row
        if BLOCK_N <= 128:  # one weight scale per K block for the whole tile
            bs_cols = bs_ptr + expert * stride_bse + (off_n // 128) * stride_bsn
        else:
            bs_cols = bs_ptr + expert * stride_bse + (offs_n // 128) * stride_bsn

        a_bufs = gl.allocate_shared_memory(
            a_desc.dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout
        )
        b_bufs = gl.allocate_shared_memory(
            b_desc.dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout
        )
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_BUFFERS):
            mbarrier.init(bars.index(s), count=1)
        for pre in gl.static_range(NUM_BUFFERS - 2):
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, pre, a_row, b_row, kb0, n_kb, NUM_BUFFERS)

        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        if OVERLAP:  # K blocks in groups of UNROLL: each block's promotion overlaps the next block's MMA
            spare0 = zero  # two dead [BLOCK_M, BLOCK_N] register sets the next products are written into
            spare1 = zero
            for g in range(0, n_kb // UNROLL):
                base = g * UNROLL
                _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, base + NUM_BUFFERS - 2, a_row, b_row, kb0, n_kb,
                            NUM_BUFFERS)  # fmt: skip
                prev = _issue_mma(a_bufs, b_bufs, bars, base, spare0, NUM_BUFFERS)
                free = spare1
                for u in gl.static_range(1, UNROLL):
                    scale = _scale(
                        as_base, bs_cols, m_ok, n_ok, kb0 + base + u - 1, stride_sk, stride_bsk, BLOCK_N
                    )
                    _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, base + u + NUM_BUFFERS - 2, a_row, b_row, kb0,
                                n_kb, NUM_BUFFERS)  # fmt: skip
                    nxt = _issue_mma(a_bufs, b_bufs, bars, base + u, free, NUM_BUFFERS)
                    done, acc = warpgroup_mma_wait(
                        num_outstanding=1, deps=(prev, acc)
                    )  # block base + u - 1 finished;
                    # acc passes through the wait so the promotion before it cannot sink below it
                    acc = _promote(acc, done, scale, BLOCK_N)
                    free = done
                    prev = nxt  # Python names: unrolled, so no register copy of an MMA in flight
                scale = _scale(
                    as_base, bs_cols, m_ok, n_ok, kb0 + base + UNROLL - 1, stride_sk, stride_bsk, BLOCK_N
                )
                done, acc = warpgroup_mma_wait(num_outstanding=0, deps=(prev, acc))
                acc = _promote(acc, done, scale, BLOCK_N)
                spare0 = free
                spare1 = done
        else:
            spare = zero  # the last finished product: its registers take the next one (no third tile)
            for i in range(0, n_kb):
                scale = _scale(as_base, bs_cols, m_ok, n_ok, kb0 + i, stride_sk, stride_bsk, BLOCK_N)
                _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, i + NUM_BUFFERS - 2, a_row, b_row, kb0, n_kb,
                            NUM_BUFFERS)  # fmt: skip
                part = _issue_mma(a_bufs, b_bufs, bars, i, spare, NUM_BUFFERS)
                spare, acc = warpgroup_mma_wait(num_outstanding=0, deps=(part, acc))
                acc = _promote(acc, spare, scale, BLOCK_N)
        for s in gl.static_range(NUM_BUFFERS):
            mbarrier.invalidate(bars.index(s))

        _store_tile(c_ptr, acc, offs_m, offs_n, m_ok, N, expert, stride_ce, stride_cm, LAYOUT, SPLIT_K)


# (BLOCK_M, BLOCK_N, num_warps, NUM_BUFFERS, UNROLL): the candidates `fp8_gemm._choose` times per shape; UNROLL
# > 1 overlaps promotion with the next MMA in groups of that many K blocks (K/128 must divide by it), 1 waits
# for each block's MMA before promoting it (overlap then comes only from a second CTA on the SM)
CONFIGS = [
    (64, 128, 4, 4, 4), (64, 128, 4, 6, 4), (128, 128, 8, 4, 4), (64, 128, 4, 4, 1),
    (128, 128, 8, 4, 1), (128, 128, 8, 4, 2), (128, 256, 8, 3, 1), (64, 256, 4, 4, 1),
]  # fmt: skip


def _shared_layout(block_shape):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.float8e4nv)


def launch(a2, a_s, w2, w_s, out, m, n, k, counts, tile_expert, layout, grid_e, cfg, a_rows_per_expert=0,
           split_k=1, *, group_m: int) -> None:  # fmt: skip
    """a2 [rows, K] fp8 (experts stacked along rows for MASKED), w2 [E * N, K] fp8, scales and out as the
    Triton kernel's `_launch` gets them (3-D, expert-major); cfg one of CONFIGS; group_m: row tiles per
    program group (fp8_gemm.group_m_for's; 1 walks the column tiles of one row tile in turn)."""
    block_m, block_n, warps, buffers, unroll = cfg
    a_desc = TensorDescriptor.from_tensor(a2, [block_m, BLOCK_K], _shared_layout([block_m, BLOCK_K]))
    b_desc = TensorDescriptor.from_tensor(w2, [block_n, BLOCK_K], _shared_layout([block_n, BLOCK_K]))
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), grid_e, split_k)
    per_expert_rows = layout == MASKED
    _fp8_gemm_sm90_kernel[grid](
        a_desc, b_desc, out, a_s, w_s, counts, tile_expert, m, n, k, a_rows_per_expert,
        out.stride(0) if per_expert_rows or split_k > 1 else 0, out.stride(1),
        a_s.stride(0) if per_expert_rows else 0, a_s.stride(1), a_s.stride(2),
        w_s.stride(0), w_s.stride(1), w_s.stride(2),
        LAYOUT=layout, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUFFERS=buffers, SPLIT_K=split_k, OVERLAP=unroll > 1, UNROLL=unroll,
        GROUP_M=group_m, num_warps=warps,
    )  # fmt: skip


def available(device: torch.device) -> bool:
    """SM90 only (WGMMA and this TMA path); off with MOEMESH_FP8_GEMM=triton."""
    if device.type != "cuda" or os.environ.get("MOEMESH_FP8_GEMM", "auto") == "triton":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9
