"""Token permutation for the local experts of one EP rank, around the grouped FP8 GEMMs.

Legend: T tokens, K top-k, P = T*K token-expert pairs, E local experts, D hidden, I expert width.

Decode (CUDA graphs, no host sync): `align_masked` gives each pair its row in an [E, M_max, D] buffer
(expert-major, the layout a low-latency EP dispatch delivers) plus per-expert counts; `moe_masked`
runs gate/up -> SwiGLU+quant -> down on that buffer and `combine` sums each token's K expert rows,
weighted. Prefill: `align_contiguous` sorts pairs by expert with each run padded to the GEMM's row
tile, for `fp8_gemm_contiguous`.
"""

from __future__ import annotations

import torch

from libs.kernels.fp8_gemm import fp8_gemm_contiguous, fp8_gemm_masked
from libs.kernels.quant import silu_mul_quant


def align_masked(local_ids: torch.Tensor, num_experts: int, m_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """local_ids [P] (expert of each pair, -1 = not on this rank) -> (dest row [P] in E*M_max or -1,
    counts [E] int32). A pair's row is its rank among the pairs of its expert, in pair order."""
    ids = local_ids.long()
    valid = ids >= 0
    # a comparison, not one_hot: one_hot checks its input range on the host, which breaks graph capture
    onehot = (ids[:, None] == torch.arange(num_experts, device=ids.device)[None, :]).long()  # [P, E]
    rank = onehot.cumsum(0).gather(1, ids.clamp(min=0)[:, None]).squeeze(1) - 1
    dest = torch.where(valid & (rank < m_max), ids * m_max + rank, -1)
    return dest, onehot.sum(0).clamp(max=m_max).to(torch.int32)


def scatter_rows(src: torch.Tensor, dest: torch.Tensor, pair_token: torch.Tensor, out: torch.Tensor):
    """out.view(-1, C)[dest[p]] = src[pair_token[p]]: the dispatch copy into the masked layout.

    Every dest must be >= 0 (all pairs local, m_max >= pairs per expert): checking that on the host
    would break CUDA-graph capture. fp8 rows are copied as bytes.
    """
    flat = out.view(-1, out.shape[-1])
    if flat.dtype == torch.float8_e4m3fn:
        flat, src = flat.view(torch.uint8), src.view(torch.uint8)
    flat.index_copy_(0, dest, src[pair_token])
    return out


def moe_masked(xq, xs, counts, w13, w13_s, w2, w2_s) -> torch.Tensor:
    """[E, M_max, D] fp8 tokens (+ scales) -> [E, M_max, D] bf16 expert outputs (rows past counts unset)."""
    gate_up = fp8_gemm_masked(xq, xs, w13, w13_s, counts)
    hq, hs = silu_mul_quant(gate_up, counts)
    return fp8_gemm_masked(hq, hs, w2, w2_s, counts)


def combine(expert_out: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [E, M_max, D], dest [T*K], weights [T, K] -> [T, D]: sum_k w[t,k] * out[dest[t,k]]."""
    t, k = weights.shape
    flat = expert_out.view(-1, expert_out.shape[-1])
    rows = flat[dest.clamp(min=0)].view(t, k, -1).float()
    w = torch.where(dest.view(t, k) >= 0, weights, 0.0)
    return torch.einsum("tkd,tk->td", rows, w).to(expert_out.dtype)


def align_contiguous(local_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort pairs by expert, pad each run to block_m (host sync: prefill only).

    Returns (order [P'] pair index per row or -1 for padding, tile_expert [P'/block_m] int32)."""
    ids = local_ids.long()
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts).tolist()
    order_parts, tiles = [], []
    sorted_pairs = torch.argsort(torch.where(ids >= 0, ids, num_experts), stable=True)
    start = 0
    for e, c in enumerate(counts):
        n_tiles = -(-c // block_m)
        run = torch.full((n_tiles * block_m,), -1, dtype=torch.long, device=ids.device)
        run[:c] = sorted_pairs[start : start + c]
        order_parts.append(run)
        tiles += [e] * n_tiles
        start += c
    order = torch.cat(order_parts) if order_parts else ids.new_empty(0)
    return order, torch.tensor(tiles, dtype=torch.int32, device=ids.device)


def moe_contiguous(xq, xs, order, tile_expert, block_m, w13, w13_s, w2, w2_s) -> torch.Tensor:
    """Prefill MoE over sorted rows: xq/xs are per pair in `order` (padding rows may hold anything)."""
    gate_up = fp8_gemm_contiguous(xq, xs, w13, w13_s, tile_expert, block_m)
    hq, hs = silu_mul_quant(gate_up)
    return fp8_gemm_contiguous(hq, hs, w2, w2_s, tile_expert, block_m)
