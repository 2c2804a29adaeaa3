"""Persistent variant of the SM90 FP8 block-scaled GEMM (`fp8_gemm_sm90`) for the dense and masked layouts:
one program per SM walks only the *active* output tiles, and its TMA ring runs across tile boundaries.

Why: a CUDA-graph decode step sizes the masked layout for the worst case (M_max rows per expert), so a
grid over every possible tile is mostly programs that exit at once (at B=256, 2,560 launched for 576 with
rows), and each short-K tile (K=2048: 16 blocks) pays its own pipeline fill and epilogue. Here the tiles
with rows are numbered on the device from the per-expert counts (expert-major, then column tile, row tile
fastest so concurrently running programs share a weight tile in L2), program p takes tiles p, p + G, ...,
and the loads of the next tile's first K blocks are issued while the current tile finishes.

The per-expert bookkeeping lives in every thread (a [E_POW2] vector per thread, no cross-warp reduction),
so E is limited to 32 experts: an EP rank's local experts, not a whole 256-expert layer.
Same math, promotion overlap (groups of UNROLL K blocks) and constraints as `fp8_gemm_sm90`.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from libs.kernels.fp8_gemm_sm90 import (
    BLOCK_K,
    MASKED,
    _issue_mma,
    _mma_layout,
    _promote,
    _scale,
    _shared_layout,
    _store_tile,
)

MAX_EXPERTS = 32
# (BLOCK_M, BLOCK_N, num_warps, NUM_BUFFERS, UNROLL)
CONFIGS = [(128, 128, 8, 4, 4), (128, 128, 8, 4, 2), (64, 128, 4, 6, 4), (64, 128, 4, 4, 2)]


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _tile_of(t, tiles_e, ends, mt, e_idx):
    """Active tile number t -> (expert, row tile, column tile); vectors are per thread, so no sync."""
    expert = gl.sum((ends <= t).to(gl.int32), 0)
    start = gl.sum(gl.where(e_idx < expert, tiles_e, 0), 0)
    mt_e = gl.maximum(gl.sum(gl.where(e_idx == expert, mt, 0), 0), 1)  # 1 past the end: loads are off
    local = t - start
    return expert, local % mt_e, local // mt_e


@gluon.jit
def _load_block(a_desc, b_desc, a_bufs, b_bufs, bars, j, n_blocks, n_kb, pid, nprog, tiles_e, ends, mt, e_idx,
                N, a_rows_per_expert, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """TMA of this program's j-th K block (its tiles' blocks in order) into ring slot j % NUM_BUFFERS."""
    lt = j // n_kb
    kb = j % n_kb
    expert, pid_m, pid_n = _tile_of(pid + lt * nprog, tiles_e, ends, mt, e_idx)
    a_row = pid_m * BLOCK_M
    if LAYOUT == 1:
        a_row += expert * a_rows_per_expert
    b_row = expert * N + pid_n * BLOCK_N
    slot = j % NUM_BUFFERS
    pred = j < n_blocks
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, kb * 128], bar, a_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, kb * 128], bar, b_bufs.index(slot), pred)


@gluon.jit
def _fp8_gemm_persistent_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, counts_ptr, M, N, K, a_rows_per_expert,
    stride_ce, stride_cm, stride_se, stride_sm, stride_sk, stride_bse, stride_bsn, stride_bsk,
    LAYOUT: gl.constexpr, E: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    vec_l: gl.constexpr = gl.BlockedLayout([E_POW2], [32], [num_warps], [0])  # whole vector in each thread
    e_idx = gl.arange(0, E_POW2, layout=vec_l)
    if LAYOUT == 1:
        cnt = gl.minimum(gl.load(counts_ptr + e_idx, mask=e_idx < E, other=0), M)
    else:
        cnt = gl.where(e_idx == 0, M, 0)
    mt = (cnt + BLOCK_M - 1) // BLOCK_M
    tiles_e = mt * gl.cdiv(N, BLOCK_N)
    ends = gl.associative_scan(tiles_e, 0, _add)  # inclusive: tiles of experts 0..e
    total = gl.sum(tiles_e, 0)
    n_kb = K // 128
    my_tiles = gl.maximum(total - pid + nprog - 1, 0) // nprog
    n_blocks = my_tiles * n_kb
    groups_per_tile = n_kb // UNROLL

    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    row_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(s), count=1)
    for pre in gl.static_range(NUM_BUFFERS - 2):
        _load_block(a_desc, b_desc, a_bufs, b_bufs, bars, pre, n_blocks, n_kb, pid, nprog, tiles_e, ends, mt,
                    e_idx, N, a_rows_per_expert, LAYOUT, BLOCK_M, BLOCK_N, NUM_BUFFERS)  # fmt: skip

    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    spare0 = zero
    spare1 = zero
    for q in range(0, my_tiles * groups_per_tile):
        gi = q % groups_per_tile
        expert, pid_m, pid_n = _tile_of(pid + (q // groups_per_tile) * nprog, tiles_e, ends, mt, e_idx)
        rows = gl.sum(gl.where(e_idx == expert, cnt, 0), 0)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
        m_ok = offs_m < rows
        n_ok = offs_n < N
        as_base = as_ptr + expert * stride_se * (LAYOUT == 1) + offs_m * stride_sm
        bs_cols = bs_ptr + expert * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
        blk = q * UNROLL  # this program's flat K-block number: ring slot and phase
        kb = gi * UNROLL
        _load_block(a_desc, b_desc, a_bufs, b_bufs, bars, blk + NUM_BUFFERS - 2, n_blocks, n_kb, pid, nprog,
                    tiles_e, ends, mt, e_idx, N, a_rows_per_expert, LAYOUT, BLOCK_M, BLOCK_N, NUM_BUFFERS)  # fmt: skip
        prev = _issue_mma(a_bufs, b_bufs, bars, blk, spare0, NUM_BUFFERS)
        free = spare1
        for u in gl.static_range(1, UNROLL):
            scale = _scale(as_base, bs_cols, m_ok, n_ok, kb + u - 1, stride_sk, stride_bsk, BLOCK_N)
            _load_block(a_desc, b_desc, a_bufs, b_bufs, bars, blk + u + NUM_BUFFERS - 2, n_blocks, n_kb, pid,
                        nprog, tiles_e, ends, mt, e_idx, N, a_rows_per_expert, LAYOUT, BLOCK_M, BLOCK_N,
                        NUM_BUFFERS)  # fmt: skip
            nxt = _issue_mma(a_bufs, b_bufs, bars, blk + u, free, NUM_BUFFERS)
            done, acc = warpgroup_mma_wait(num_outstanding=1, deps=(prev, acc))
            acc = _promote(acc, done, scale, BLOCK_N)
            free = done
            prev = nxt
        scale = _scale(as_base, bs_cols, m_ok, n_ok, kb + UNROLL - 1, stride_sk, stride_bsk, BLOCK_N)
        done, acc = warpgroup_mma_wait(num_outstanding=0, deps=(prev, acc))
        acc = _promote(acc, done, scale, BLOCK_N)
        spare0 = free
        spare1 = done
        if gi == groups_per_tile - 1:  # the tile's last K group: write it out, start the next from zero
            _store_tile(c_ptr, acc, offs_m, offs_n, m_ok, N, expert, stride_ce, stride_cm, LAYOUT, 1)
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for s in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(s))


_NUM_SMS: dict[int, int] = {}


def applies(layout: int, experts: int, k: int, cfg) -> bool:
    return layout in (0, MASKED) and experts <= MAX_EXPERTS and (k // BLOCK_K) % cfg[4] == 0


def launch(a2, a_s, w2, w_s, out, m, n, k, counts, layout, experts, cfg, a_rows_per_expert=0) -> None:
    """As `fp8_gemm_sm90.launch` (dense or masked; `experts` row blocks), one program per SM."""
    block_m, block_n, warps, buffers, unroll = cfg
    a_desc = TensorDescriptor.from_tensor(a2, [block_m, BLOCK_K], _shared_layout([block_m, BLOCK_K]))
    b_desc = TensorDescriptor.from_tensor(w2, [block_n, BLOCK_K], _shared_layout([block_n, BLOCK_K]))
    dev = a2.device.index or 0
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    masked = layout == MASKED
    _fp8_gemm_persistent_kernel[(_NUM_SMS[dev],)](
        a_desc, b_desc, out, a_s, w_s, counts, m, n, k, a_rows_per_expert,
        out.stride(0) if masked else 0, out.stride(1), a_s.stride(0) if masked else 0, a_s.stride(1),
        a_s.stride(2), w_s.stride(0), w_s.stride(1), w_s.stride(2),
        LAYOUT=layout, E=experts, E_POW2=triton.next_power_of_2(max(experts, 2)), BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_BUFFERS=buffers, UNROLL=unroll, num_warps=warps,
    )  # fmt: skip
