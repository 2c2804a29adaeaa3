"""Hopper (SM90) FP8 block-scaled GEMM in Gluon, persistent and warp-specialized (DeepGEMM's scheme): one program an
SM walks the output tiles (fp8_gemm_sm90's layouts, program order and math); a one-warp producer brings each
tile's A and B K blocks by TMA into a ring, two consumer warpgroups each take 64 of the tile's 128 rows, issue
the WGMMAs and promote each 128-deep partial with its scales while the next one runs. A tile's epilogue (the
stores) overlaps the producer's loads of the next tile, and no program waits for a launch.

Not among fp8_gemm's tuned candidates until measured on a GPU (bench.kernels times it beside them)."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from libs.kernels import fp8_gemm_sm90 as sm90

BLOCK_M = gl.constexpr(128)  # rows a tile: 64 a consumer warpgroup
HALF_M = gl.constexpr(64)
# (BLOCK_N, NUM_BUFFERS, UNROLL): UNROLL K blocks a group, each block's promotion overlapping the next one's MMA
CONFIGS = [(128, 6, 2), (128, 6, 4), (128, 4, 2)]


@gluon.jit
def _tile(t, num_m, num_n, M, counts_ptr, tile_expert_ptr, LAYOUT: gl.constexpr, GROUP_M: gl.constexpr):
    """Output tile t of the persistent walk -> (expert, pid_m, pid_n, rows, active): MASKED walks each
    expert's tiles in turn (fp8_gemm_sm90's program order within one), the others one grid of tiles."""
    per_expert = num_m * num_n
    expert = 0
    rows = M
    if LAYOUT == 1:
        expert = t // per_expert
        rows = gl.load(counts_ptr + expert)
    pid_m, pid_n = sm90._grouped_tile(t % per_expert, num_m, num_n, GROUP_M)
    if LAYOUT == 2:
        expert = gl.load(tile_expert_ptr + pid_m)
    return expert, pid_m, pid_n, rows, (pid_m * BLOCK_M < rows) & (expert >= 0)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, full, empty, counts_ptr, tile_expert_ptr, M, N, K, a_rows_per_expert,
              total, num_m, num_n, LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
              GROUP_M: gl.constexpr):  # fmt: skip
    """One warp: every active tile's K blocks into the ring, a slot once both consumers are done with it."""
    it = 0  # K blocks loaded so far (the ring position)
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, pid_m, pid_n, rows, active = _tile(t, num_m, num_n, M, counts_ptr, tile_expert_ptr, LAYOUT, GROUP_M)
        if active:
            a_row, b_row, kb0, n_kb = sm90._tile_origin(expert, pid_m * BLOCK_M, pid_n * BLOCK_N, N, K,
                                                        a_rows_per_expert, LAYOUT, 1)  # fmt: skip
            for kb in range(n_kb):
                slot = it % NUM_BUFFERS
                # a fresh mbarrier counts as having completed the phase before its first: the first round passes
                mbarrier.wait(empty.index(slot), ((it // NUM_BUFFERS) & 1) ^ 1)
                bar = full.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [a_row, (kb0 + kb) * 128], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(b_desc, [b_row, (kb0 + kb) * 128], bar, b_bufs.index(slot))
                it += 1


@gluon.jit
def _mma(a_bufs, b_bufs, full, it, regs, W: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """Wait for ring position it's tiles, then start (asynchronously) this warpgroup's 64-row product of them
    into `regs` (a dead tensor of the partial's shape; its value is unused)."""
    slot = it % NUM_BUFFERS
    mbarrier.wait(full.index(slot), (it // NUM_BUFFERS) & 1)
    a = a_bufs.index(slot).slice(W * HALF_M, HALF_M, 0)
    return warpgroup_mma(a, b_bufs.index(slot).permute((1, 0)), regs, use_acc=False, is_async=True)


@gluon.jit
def _consumer(W: gl.constexpr, a_bufs, b_bufs, full, empty, c_ptr, as_ptr, bs_ptr, counts_ptr, tile_expert_ptr, M, N,
              K, a_rows_per_expert, total, num_m, num_n, stride_ce, stride_cm, stride_se, stride_sm, stride_sk,
              stride_bse, stride_bsn, stride_bsk, LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_BUFFERS: gl.constexpr, UNROLL: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """Warpgroup W: rows [64 W, 64 W + 64) of every active tile, K blocks in groups of UNROLL (no WGMMA result
    crosses a group, a branch or the loop's back edge in flight: ptxas would serialize them all)."""
    mma_layout: gl.constexpr = sm90._mma_layout(HALF_M, BLOCK_N, 4)
    row_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
    zero = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    it = 0  # K blocks consumed so far (the ring position; the producer's count)
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, pid_m, pid_n, rows, active = _tile(t, num_m, num_n, M, counts_ptr, tile_expert_ptr, LAYOUT, GROUP_M)
        if active:
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            a_row, b_row, kb0, n_kb = sm90._tile_origin(expert, off_m, off_n, N, K, a_rows_per_expert, LAYOUT, 1)
            offs_m = off_m + W * HALF_M + gl.arange(0, HALF_M, layout=row_l)
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=col_l)
            m_ok = offs_m < rows
            as_base = as_ptr + expert * stride_se * (LAYOUT == 1) + offs_m * stride_sm
            bs_cols = bs_ptr + expert * stride_bse + (off_n // 128) * stride_bsn
            acc = zero
            spare0 = zero  # two dead register sets the products are written into
            spare1 = zero
            for g in range(0, n_kb // UNROLL):
                base = it + g * UNROLL
                prev = _mma(a_bufs, b_bufs, full, base, spare0, W, NUM_BUFFERS)
                free = spare1
                for u in gl.static_range(1, UNROLL):
                    scale = sm90._scale(as_base, bs_cols, m_ok, offs_n < N, kb0 + g * UNROLL + u - 1, stride_sk,
                                        stride_bsk, BLOCK_N)  # fmt: skip
                    nxt = _mma(a_bufs, b_bufs, full, base + u, free, W, NUM_BUFFERS)
                    done, acc = warpgroup_mma_wait(num_outstanding=1, deps=(prev, acc))  # block u - 1 finished
                    mbarrier.arrive(empty.index((base + u - 1) % NUM_BUFFERS))
                    acc = sm90._promote(acc, done, scale, BLOCK_N)
                    free = done
                    prev = nxt  # Python names: unrolled, so no register copy of an MMA in flight
                scale = sm90._scale(as_base, bs_cols, m_ok, offs_n < N, kb0 + g * UNROLL + UNROLL - 1, stride_sk,
                                    stride_bsk, BLOCK_N)  # fmt: skip
                done, acc = warpgroup_mma_wait(num_outstanding=0, deps=(prev, acc))
                mbarrier.arrive(empty.index((base + UNROLL - 1) % NUM_BUFFERS))
                acc = sm90._promote(acc, done, scale, BLOCK_N)
                spare0 = free
                spare1 = done
            it += n_kb
            sm90._store_tile(c_ptr, acc, offs_m, offs_n, m_ok, N, expert, stride_ce, stride_cm, LAYOUT, 1)


@gluon.jit(do_not_specialize=["M", "a_rows_per_expert"])
def _fp8_gemm_sm90_ws_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, counts_ptr, tile_expert_ptr,
    M, N, K, a_rows_per_expert, num_e,
    stride_ce, stride_cm, stride_se, stride_sm, stride_sk, stride_bse, stride_bsn, stride_bsk,
    LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, UNROLL: gl.constexpr,
    GROUP_M: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    total = num_m * num_n * num_e
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUFFERS):
        mbarrier.init(full.index(s), count=1)  # the producer's expect + the TMA bytes
        mbarrier.init(empty.index(s), count=2)  # both consumers' MMAs on the slot done
    gl.warp_specialize(
        [
            (_consumer, (0, a_bufs, b_bufs, full, empty, c_ptr, as_ptr, bs_ptr, counts_ptr, tile_expert_ptr, M, N, K,
                         a_rows_per_expert, total, num_m, num_n, stride_ce, stride_cm, stride_se, stride_sm,
                         stride_sk, stride_bse, stride_bsn, stride_bsk, LAYOUT, BLOCK_N, NUM_BUFFERS, UNROLL,
                         GROUP_M)),
            (_consumer, (1, a_bufs, b_bufs, full, empty, c_ptr, as_ptr, bs_ptr, counts_ptr, tile_expert_ptr, M, N, K,
                         a_rows_per_expert, total, num_m, num_n, stride_ce, stride_cm, stride_se, stride_sm,
                         stride_sk, stride_bse, stride_bsn, stride_bsk, LAYOUT, BLOCK_N, NUM_BUFFERS, UNROLL,
                         GROUP_M)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, full, empty, counts_ptr, tile_expert_ptr, M, N, K,
                         a_rows_per_expert, total, num_m, num_n, LAYOUT, BLOCK_N, NUM_BUFFERS, GROUP_M)),
        ],
        [4, 1],
        [232, 24],
    )  # fmt: skip
    for s in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(full.index(s))
        mbarrier.invalidate(empty.index(s))


def launch(a2, a_s, w2, w_s, out, m, n, k, counts, tile_expert, layout, grid_e, cfg, a_rows_per_expert=0, *,
           group_m: int) -> None:  # fmt: skip
    """fp8_gemm_sm90.launch's contract without split-K; cfg one of CONFIGS (K / 128 a multiple of its UNROLL,
    N a multiple of its BLOCK_N); one program an SM, each walking the tiles."""
    block_n, buffers, unroll = cfg
    if (k // 128) % unroll or n % block_n or k % 128:
        raise ValueError(f"config {cfg} needs K / 128 divisible by {unroll} and N by {block_n}: N={n}, K={k}")
    a_desc = TensorDescriptor.from_tensor(a2, [BLOCK_M, sm90.BLOCK_K], sm90._shared_layout([BLOCK_M, sm90.BLOCK_K]))
    b_desc = TensorDescriptor.from_tensor(w2, [block_n, sm90.BLOCK_K], sm90._shared_layout([block_n, sm90.BLOCK_K]))
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, block_n) * grid_e
    programs = min(tiles, torch.cuda.get_device_properties(a2.device).multi_processor_count)
    per_expert_rows = layout == sm90.MASKED
    _fp8_gemm_sm90_ws_kernel[(programs,)](
        a_desc, b_desc, out, a_s, w_s, counts, tile_expert, m, n, k, a_rows_per_expert, grid_e,
        out.stride(0) if per_expert_rows else 0, out.stride(1),
        a_s.stride(0) if per_expert_rows else 0, a_s.stride(1), a_s.stride(2),
        w_s.stride(0), w_s.stride(1), w_s.stride(2),
        LAYOUT=layout, BLOCK_N=block_n, NUM_BUFFERS=buffers, UNROLL=unroll, GROUP_M=group_m, num_warps=4,
        maxnreg=168,
    )  # fmt: skip
