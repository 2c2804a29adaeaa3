"""Local-expert MoE around the grouped GEMMs: masked (decode) and contiguous (prefill) paths both equal
a per-token loop over dequantized experts with the same fp8 activation rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels import fp8_gemm as G  # noqa: E402
from libs.kernels import moe_ops as M  # noqa: E402
from libs.kernels import quant as Q  # noqa: E402
from libs.quant.fp8 import dequantize_fp8_groups, quantize_fp8_groups  # noqa: E402

T, K, E, D, I = 6, 4, 3, 256, 128


def _setup(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, E, (T, K), generator=g).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    w13 = torch.randn(E, 2 * I, D, generator=g).to(G.FP8).to(device)
    w13s = (torch.rand(E, 2, 2, generator=g) * 0.01 + 0.01).to(device)
    w2 = torch.randn(E, D, I, generator=g).to(G.FP8).to(device)
    w2s = (torch.rand(E, 2, 1, generator=g) * 0.01 + 0.01).to(device)
    return x, ids, w, (w13, w13s, w2, w2s)


def _reference(xq, xs, ids, w, weights):
    w13, w13s, w2, w2s = weights
    xd = dequantize_fp8_groups(xq, xs)
    out = torch.zeros(T, D, device=xq.device)
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            h = (xd[t] @ G.dequant_blocks(w13[e], w13s[e]).T).to(torch.bfloat16)  # the kernel's bf16 round
            aq, a_s = quantize_fp8_groups(Q.silu_mul_reference(h[None]))
            out[t] += w[t, k] * (dequantize_fp8_groups(aq, a_s)[0] @ G.dequant_blocks(w2[e], w2s[e]).T)
    return out


def test_align_masked_ranks_pairs_per_expert(device):
    ids = torch.tensor([2, 0, 2, -1, 2], device=device)
    dest, counts = M.align_masked(ids, 3, 4)
    assert dest.tolist() == [8, 0, 9, -1, 10]
    assert counts.tolist() == [1, 0, 3]


def test_align_kernel_equals_reference_across_blocks_and_overflow(device):
    """P spans three of the kernel's 1024-pair blocks; m_max is below some experts' load (their extra
    pairs are dropped, counts capped); -1 pairs are skipped."""
    g = torch.Generator().manual_seed(3)
    for experts, m_max in [(5, 2304), (5, 300), (40, 2304)]:  # 40 experts: the kernel's smaller pair blocks
        ids = torch.randint(-1, experts, (2304,), generator=g).to(device)
        dest, counts = M.align_masked(ids, experts, m_max)
        ref_dest, ref_counts = M.align_masked_reference(ids, experts, m_max)
        assert torch.equal(dest.cpu(), ref_dest.cpu())
        assert torch.equal(counts.cpu(), ref_counts.cpu())
        if m_max == 300:
            assert (ref_dest == -1).sum() > (ids == -1).sum()  # the capped case really dropped pairs


def test_masked_moe_matches_per_token_loop(device):
    x, ids, w, weights = _setup(device)
    xq, xs = Q.quant_fp8_groups(x)
    m_max = T * K
    dest, counts = M.align_masked(ids.view(-1), E, m_max)
    bq = torch.zeros(E, m_max, D, dtype=G.FP8, device=device)
    bs = torch.ones(E, m_max, D // 128, device=device)
    pair_token = torch.arange(T, device=device).repeat_interleave(K)
    M.scatter_rows(xq, dest, pair_token, bq)
    M.scatter_rows(xs, dest, pair_token, bs)
    y = M.combine(M.moe_masked(bq, bs, counts, *weights), dest, w)
    ref = _reference(xq, xs, ids, w, weights)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_contiguous_moe_matches_per_token_loop(device):
    x, ids, w, weights = _setup(device)
    xq, xs = Q.quant_fp8_groups(x)
    order, tile_expert = M.align_contiguous(ids.view(-1), E, 16)
    pair_token = torch.arange(T, device=device).repeat_interleave(K)
    rows = pair_token[order.clamp(min=0)]
    out_rows = M.moe_contiguous(xq[rows], xs[rows], order, tile_expert, 16, *weights)
    y = torch.zeros(T, D, device=device)
    valid = order >= 0
    y.index_add_(0, pair_token[order[valid]], out_rows[valid].float() * w.view(-1)[order[valid]][:, None])
    ref = _reference(xq, xs, ids, w, weights)
    assert ((y - ref).norm() / ref.norm()).item() < 2e-2


def test_fused_dispatch_and_combine_match_the_unfused_ops(device):
    x, ids, w, _ = _setup(device)
    m_max = T * K
    dest, _ = M.align_masked(ids.view(-1), E, m_max)
    dest[3] = -1  # a dropped pair is neither written nor summed
    bq = torch.zeros(E, m_max, D, dtype=G.FP8, device=device)
    bs = torch.full((E, m_max, D // 128), -1.0, device=device)
    M.dispatch_quant(x, dest, bq, bs)
    xq, xs = Q.quant_fp8_groups(x)
    pair_token = torch.arange(T, device=device).repeat_interleave(K)
    for p, row in enumerate(dest.tolist()):
        if row >= 0:
            assert torch.equal(bq.view(-1, D)[row].view(torch.uint8), xq[pair_token[p]].view(torch.uint8))
            assert torch.equal(bs.view(-1, D // 128)[row], xs[pair_token[p]])
    assert (bs.view(-1, D // 128) == -1).all(-1).sum() == E * m_max - (dest >= 0).sum()
    rows = torch.randn(E, m_max, D).to(torch.bfloat16).to(device)
    shared = torch.randn(T, D).to(torch.bfloat16).to(device)
    got = M.combine_fused(rows, dest, w, add=shared)
    ref = M.combine(rows, dest, w).float() + shared.float()
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_masked_moe_over_rows_quantized_already_equals_quantizing_them_itself(device):
    """fp8_moe(quantized=...): an EP rank's received FP8 rows go into the expert buffers as they are; with the
    rows the kernels would have made, the output is the same, bit for bit."""
    from libs.kernels.backend import fp8_moe

    x, ids, w, (w13, w13s, w2, w2s) = _setup(device)
    ids[1, 2] = -1  # a pick on another rank
    want = fp8_moe(x, ids, w, (w13, w13s), (w2, w2s), masked=True)
    got = fp8_moe(x, ids, w, (w13, w13s), (w2, w2s), masked=True, quantized=Q.quant_fp8_groups(x))
    assert torch.equal(got, want)


def _align_contiguous_loop(ids: torch.Tensor, num_experts: int, block_m: int):
    """align_contiguous expert by expert, as it was written first: the reference."""
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts).tolist()
    sorted_pairs = torch.argsort(torch.where(ids >= 0, ids, num_experts), stable=True)
    parts, tiles, start = [], [], 0
    for e, c in enumerate(counts):
        n_tiles = -(-c // block_m)
        run = torch.full((n_tiles * block_m,), -1, dtype=torch.long)
        run[:c] = sorted_pairs[start : start + c]
        parts.append(run)
        tiles += [e] * n_tiles
        start += c
    return torch.cat(parts), torch.tensor(tiles, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_align_contiguous_equals_the_per_expert_loop(seed):
    """Sized by the routing (one host sync): the loop's layout. Sized by the shapes (`contiguous_tiles`, no
    sync): the same layout, then empty tiles."""
    g = torch.Generator().manual_seed(seed)
    num_experts, block_m = 9, 4
    ids = torch.randint(-1, num_experts, (57,), generator=g)  # -1: a pair routed elsewhere
    ids[ids == 5] = 3  # an expert without rows: no tile
    want_order, want_tiles = _align_contiguous_loop(ids, num_experts, block_m)
    order, tile_expert = M.align_contiguous(ids, num_experts, block_m)
    assert torch.equal(order, want_order) and torch.equal(tile_expert, want_tiles)
    tiles = M.contiguous_tiles(57, num_experts, block_m)
    order, tile_expert = M.align_contiguous(ids, num_experts, block_m, tiles)
    assert tile_expert.numel() == tiles and order.numel() == block_m * tiles and tiles >= want_tiles.numel()
    assert torch.equal(order[: want_order.numel()], want_order) and (order[want_order.numel() :] == -1).all()
    assert torch.equal(tile_expert[: want_tiles.numel()], want_tiles)
    assert (tile_expert[want_tiles.numel() :] == -1).all() and 5 not in tile_expert.tolist()


def test_contiguous_tiles_fit_the_worst_routing():
    """Every expert's run one row past a tile boundary: the most tiles any routing of P pairs needs."""
    num_experts, block_m = 7, 16
    ids = torch.arange(num_experts).repeat_interleave(block_m + 1)
    tiles = M.contiguous_tiles(ids.numel(), num_experts, block_m)
    order, tile_expert = M.align_contiguous(ids, num_experts, block_m, tiles)
    assert (tile_expert >= 0).sum() == 2 * num_experts == tiles
    assert sorted(order[order >= 0].tolist()) == list(range(ids.numel()))


def test_align_contiguous_of_no_pairs():
    order, tile_expert = M.align_contiguous(torch.full((6,), -1), 4, 16)
    assert order.numel() == 0 and tile_expert.numel() == 0 and tile_expert.dtype == torch.int32
    order, tile_expert = M.align_contiguous(torch.full((6,), -1), 4, 16, M.contiguous_tiles(6, 4, 16))
    assert (order == -1).all() and (tile_expert == -1).all() and order.numel() == 16 * tile_expert.numel() > 0


def test_contiguous_moe_sized_by_shapes_or_by_routing_gives_one_answer(device):
    """fp8_moe's contiguous layout sized from the shapes (all_local: no host sync, empty tiles neither
    computed nor read) equals the one sized from the routing, and pairs routed elsewhere add nothing."""
    from libs.kernels.backend import fp8_moe

    x, ids, w, weights = _setup(device)
    w13, w2 = weights[:2], weights[2:]
    by_routing = fp8_moe(x, ids, w, w13, w2, masked=False, block_m=16)
    assert torch.equal(fp8_moe(x, ids, w, w13, w2, masked=False, block_m=16, all_local=True), by_routing)
    dropped = ids.clone()
    dropped[:, -1] = -1
    want = fp8_moe(x, ids[:, :-1].contiguous(), w[:, :-1].contiguous(), w13, w2, masked=False, block_m=16)
    torch.testing.assert_close(fp8_moe(x, dropped, w, w13, w2, masked=False, block_m=16), want)
