"""Token permutation for the local experts of one EP rank, around the grouped FP8 GEMMs. Decode (CUDA graphs,
no host sync): `align_masked` -> `moe_masked` -> `combine` over an [E, M_max, D] expert-major buffer; prefill:
`align_contiguous` sorts pairs by expert, runs padded to the GEMM's row tile (sized by the shapes or the routing)."""

# Legend: T tokens, K top-k, P = T*K token-expert pairs, E local experts, D hidden, I expert width.
# The masked buffer is the layout a low-latency EP dispatch delivers; moe_masked runs gate/up -> SwiGLU+quant
# -> down on it, and combine sums each token's K expert rows, weighted.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.kernels.fp8_gemm import fp8_gemm_contiguous, fp8_gemm_masked, triton_usable
from libs.kernels.quant import silu_mul_quant
from libs.quant.fp8 import FP8_GROUP as GROUP
from libs.quant.fp8 import FP8_MAX


@triton.jit
def _dispatch_kernel(
    X, DEST, OQ, OS, D, stride_x, stride_q, stride_s,
    TOPK: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr, FMAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    g = tl.arange(0, GROUPS_POW2)
    offs = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = offs < D
    x = tl.load(X + t.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-10) / FMAX
    xq = (x / scale[:, None]).to(OQ.dtype.element_ty)
    for k in tl.static_range(TOPK):
        row = tl.load(DEST + t * TOPK + k).to(tl.int64)
        if row >= 0:
            tl.store(OQ + row * stride_q + offs, xq, mask=mask)
            tl.store(OS + row * stride_s + g, scale, mask=g * GROUP_SIZE < D)


def dispatch_quant(x: torch.Tensor, dest: torch.Tensor, out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Quantize each token row once (1x128 fp8) and store it at its K destination rows:
    x [T, D] bf16, dest [T*K] rows of out_q [E, M_max, D] / out_s [E, M_max, D/128] (-1: skip)."""
    t, d = x.shape
    if t == 0:
        return
    k = dest.numel() // t
    q2, s2 = out_q.view(-1, d), out_s.view(-1, d // GROUP)
    _dispatch_kernel[(t,)](
        x, dest, q2, s2, d, x.stride(0), q2.stride(0), s2.stride(0),
        TOPK=k, GROUPS_POW2=triton.next_power_of_2(d // GROUP), GROUP_SIZE=GROUP, FMAX=FP8_MAX, num_warps=8,
    )  # fmt: skip


@triton.jit
def _combine_kernel(
    ROWS, DEST, W, ADD, OUT, D, stride_r, stride_a, stride_o,
    TOPK: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_ADD:
        acc += tl.load(ADD + t.to(tl.int64) * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(TOPK):
        row = tl.load(DEST + t * TOPK + k).to(tl.int64)
        w = tl.load(W + t * TOPK + k)
        if row >= 0:
            acc += w * tl.load(ROWS + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + t.to(tl.int64) * stride_o + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def combine_fused(expert_out, dest, weights, add=None) -> torch.Tensor:
    """combine() in one kernel, plus an optional [T, D] term (the shared expert) added in fp32."""
    t, k = weights.shape
    rows = expert_out.view(-1, expert_out.shape[-1])
    d = rows.shape[1]
    out = torch.empty(t, d, dtype=expert_out.dtype, device=expert_out.device)
    if t == 0:
        return out
    block = 1024
    _combine_kernel[(t, triton.cdiv(d, block))](
        rows, dest, weights.contiguous(), add if add is not None else out, out, d, rows.stride(0),
        add.stride(0) if add is not None else 0, out.stride(0), TOPK=k, HAS_ADD=add is not None, BLOCK=block,
        num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _align_kernel(IDS, DEST, COUNTS, P, M_MAX, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """One program walks the pairs in blocks: a pair's row is the running count of its expert before the
    block plus its rank within the block (an inclusive scan of the block's one-hot)."""
    experts = tl.arange(0, E_POW2)
    running = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, P, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(IDS + offs, mask=offs < P, other=-1)
        hit = (ids[None, :] == experts[:, None]).to(tl.int32)  # [E_POW2, BLOCK]
        rank = tl.cumsum(hit, 1) - 1 + running[:, None]
        mine = tl.sum(tl.where(hit > 0, rank, 0), 0)  # [BLOCK]: the rank in its own expert's column
        ok = (ids >= 0) & (ids < E) & (mine < M_MAX)
        tl.store(DEST + offs, tl.where(ok, ids.to(tl.int64) * M_MAX + mine, -1), mask=offs < P)
        running += tl.sum(hit, 1)
    tl.store(COUNTS + experts, tl.minimum(running, M_MAX), mask=experts < E)


def align_masked(local_ids: torch.Tensor, num_experts: int, m_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """local_ids [P] (expert of each pair, -1 = not on this rank) -> (dest row [P] in E*M_max or -1,
    counts [E] int32). A pair's row is its rank among the pairs of its expert, in pair order.
    One Triton program on CUDA (and under the interpreter); the torch reference elsewhere."""
    if not triton_usable(local_ids):
        return align_masked_reference(local_ids, num_experts, m_max)
    p = local_ids.numel()
    dest = torch.empty(p, dtype=torch.int64, device=local_ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=local_ids.device)
    e_pow2 = triton.next_power_of_2(max(num_experts, 2))
    block = max(
        32, min(1024, 16384 // e_pow2)
    )  # the one-hot tile stays <= 16K entries (256 experts: 64 pairs)
    _align_kernel[(1,)](
        local_ids.contiguous(), dest, counts, p, m_max, E=num_experts, E_POW2=e_pow2, BLOCK=block, num_warps=8,
    )  # fmt: skip
    return dest, counts


def align_masked_reference(local_ids: torch.Tensor, num_experts: int, m_max: int):
    """align_masked in torch ops (no host sync either)."""
    ids = local_ids.long()
    valid = ids >= 0
    # A comparison, not one_hot (which checks its input range on the host and so breaks graph
    # capture); expert-major [E, P] so the scan runs along the inner dim (an outer-dim scan is slow on the GPU).
    onehot = (ids[None, :] == torch.arange(num_experts, device=ids.device)[:, None]).int()  # [E, P]
    rank = onehot.cumsum(1).gather(0, ids.clamp(min=0)[None, :]).squeeze(0) - 1
    dest = torch.where(valid & (rank < m_max), ids * m_max + rank, -1)
    return dest, onehot.sum(1).clamp(max=m_max).to(torch.int32)


def scatter_rows(src: torch.Tensor, dest: torch.Tensor, pair_token: torch.Tensor, out: torch.Tensor):
    """out.view(-1, C)[dest[p]] = src[pair_token[p]]: the dispatch copy into the masked layout (fp8 rows as
    bytes). Every dest must be >= 0 (all pairs local, m_max >= pairs per expert): unchecked, since checking
    on the host would break CUDA-graph capture."""
    flat = out.view(-1, out.shape[-1])
    if flat.dtype == torch.float8_e4m3fn:
        flat, src = flat.view(torch.uint8), src.view(torch.uint8)
    flat.index_copy_(0, dest, src[pair_token])
    return out


def moe_masked(xq, xs, counts, w13, w13_s, w2, w2_s, out_dtype=torch.bfloat16) -> torch.Tensor:
    """[E, M_max, D] fp8 tokens (+ scales) -> [E, M_max, D] expert outputs in out_dtype (rows past counts
    unset)."""
    gate_up = fp8_gemm_masked(xq, xs, w13, w13_s, counts, out_dtype=out_dtype)
    hq, hs = silu_mul_quant(gate_up, counts)
    return fp8_gemm_masked(hq, hs, w2, w2_s, counts, out_dtype=out_dtype)


def combine(expert_out: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [E, M_max, D], dest [T*K], weights [T, K] -> [T, D]: sum_k w[t,k] * out[dest[t,k]]."""
    t, k = weights.shape
    flat = expert_out.view(-1, expert_out.shape[-1])
    rows = flat[dest.clamp(min=0)].view(t, k, -1).float()
    w = torch.where(dest.view(t, k) >= 0, weights, 0.0)
    return torch.einsum("tkd,tk->td", rows, w).to(expert_out.dtype)


def contiguous_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Row tiles enough for any routing of `pairs` pairs over `num_experts` experts (sum of
    ceil(count_e / block_m) <= (pairs + E * (block_m - 1)) // block_m): a layout size from the shapes alone."""
    return (pairs + num_experts * (block_m - 1)) // block_m


def align_contiguous(local_ids: torch.Tensor, num_experts: int, block_m: int, tiles: int | None = None):
    """Sort pairs by expert, each expert's run padded to block_m, in a fixed number of tensor ops. tiles: the
    row tiles to lay out, at least what the routing needs (`contiguous_tiles` bounds any routing): no host
    sync, the tiles past the routing's own empty; None: exactly the routing's, read back (one host sync).
    Returns (order [tiles * block_m] pair index per row or -1 for padding, tile_expert [tiles] int32, -1 for an
    empty tile)."""
    ids = local_ids.long().view(-1)
    p, e = ids.numel(), num_experts
    key = torch.where((ids >= 0) & (ids < e), ids, e)  # e: routed elsewhere
    counts = torch.zeros(e + 1, dtype=torch.long, device=ids.device).scatter_add_(0, key, torch.ones_like(key))[:e]
    per_expert = (counts + block_m - 1) // block_m  # [E] row tiles per expert
    cum_tiles = torch.cumsum(per_expert, 0)
    if tiles is None:
        tiles = int(cum_tiles[-1])  # the host sync
    padded_start = (cum_tiles - per_expert) * block_m  # [E] first row of each expert's run
    run_start = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    sorted_pairs = torch.argsort(key, stable=True)  # pairs routed elsewhere last
    expert = key[sorted_pairs]
    mine = expert.clamp(max=e - 1)
    rank = torch.arange(p, device=ids.device) - run_start[mine]
    row = torch.where(expert < e, padded_start[mine] + rank, tiles * block_m)  # past the end: dropped
    order = torch.full((tiles * block_m + 1,), -1, dtype=torch.long, device=ids.device)
    order.scatter_(0, row, sorted_pairs)
    tile_expert = torch.searchsorted(cum_tiles, torch.arange(tiles, device=ids.device), right=True)
    return order[:-1], torch.where(tile_expert < e, tile_expert, -1).to(torch.int32)


def moe_contiguous(
    xq, xs, order, tile_expert, block_m, w13, w13_s, w2, w2_s, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """Prefill MoE over sorted rows: xq/xs are per pair in `order` (padding rows may hold anything). Rows of
    empty tiles (tile_expert -1) are neither computed nor quantized: their output rows hold no values."""
    gate_up = fp8_gemm_contiguous(xq, xs, w13, w13_s, tile_expert, block_m, out_dtype=out_dtype)
    tiles = tile_expert.numel()
    rows_per_tile = torch.where(tile_expert >= 0, block_m, 0).to(torch.int32)  # the masked mode's counts
    hq, hs = silu_mul_quant(gate_up.view(tiles, block_m, -1), rows_per_tile)
    return fp8_gemm_contiguous(
        hq.view(tiles * block_m, -1), hs.view(tiles * block_m, -1), w2, w2_s, tile_expert, block_m, out_dtype=out_dtype
    )
