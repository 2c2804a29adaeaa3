"""Block-scaled FP8 GEMMs (dense, masked, contiguous) vs dequantize-then-multiply in float32."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels import fp8_gemm as G  # noqa: E402
from libs.kernels.quant import quant_fp8_groups  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402


def _weights(e, n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) * 2).to(G.FP8)
    ws = torch.rand(e, -(-n // 128), k // 128, generator=g) * 0.02 + 0.005
    return w.to(device), ws.to(device)


def _acts(shape, device, seed=1):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(device)
    return quant_fp8_groups(x)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_dense_with_ragged_n(device):
    xq, xs = _acts((40, 256), device)
    w, ws = _weights(1, 192, 256, device)  # N not a multiple of 128, like kv_a_proj's 576
    out = G.fp8_gemm(xq, xs, w[0], ws[0])
    assert out.shape == (40, 192)
    assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2


def test_masked_writes_only_counted_rows(device):
    xq, xs = _acts((3, 48, 256), device)
    w, ws = _weights(3, 128, 256, device)
    counts = torch.tensor([0, 17, 48], dtype=torch.int32, device=device)
    out = torch.full((3, 48, 128), float("nan"), dtype=torch.bfloat16, device=device)
    G.fp8_gemm_masked(xq, xs, w, ws, counts, out=out, block_m=16)
    ref = G.fp8_gemm_reference(xq, xs, w, ws)
    for e, c in enumerate(counts.tolist()):
        assert out[e, c:].isnan().all()
        if c:
            assert _rel(out[e, :c], ref[e, :c]) < 1e-2


def test_contiguous_uses_each_tiles_expert_and_skips_padding(device):
    xq, xs = _acts((64, 256), device)
    w, ws = _weights(3, 128, 256, device)
    tile_expert = torch.tensor([2, 2, -1, 0], dtype=torch.int32, device=device)
    out = torch.full((64, 128), float("nan"), dtype=torch.bfloat16, device=device)
    G.fp8_gemm_contiguous(xq, xs, w, ws, tile_expert, 16, out=out)
    for t, e in enumerate(tile_expert.tolist()):
        rows = slice(16 * t, 16 * (t + 1))
        if e < 0:
            assert out[rows].isnan().all()
        else:
            assert _rel(out[rows], G.fp8_gemm_reference(xq[rows], xs[rows], w[e], ws[e])) < 1e-2


@pytest.mark.parametrize("num_m,num_n,group_m", [(37, 5, 16), (4, 56, 16), (64, 32, 16), (7, 3, 1), (9, 4, 2)])
def test_grouped_tile_order_is_a_permutation_in_groups(device, num_m, num_n, group_m):
    """grouped_tile, the programs' order: every (row tile, column tile) once; consecutive programs walk at
    most group_m row tiles before the column tile moves on (decode's few row tiles: one group)."""
    import triton
    import triton.language as tl

    @triton.jit
    def where(out, num_m, num_n, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        pid_m, pid_n = G.grouped_tile(pid, num_m, num_n, GROUP_M)
        tl.store(out + 2 * pid, pid_m)
        tl.store(out + 2 * pid + 1, pid_n)

    out = torch.full((num_m * num_n, 2), -1, dtype=torch.int32, device=device)
    where[(num_m * num_n,)](out, num_m, num_n, GROUP_M=group_m)
    got = [tuple(t) for t in out.tolist()]
    assert sorted(got) == [(m, n) for m in range(num_m) for n in range(num_n)]
    for first, (m, n) in enumerate(got[: min(group_m, num_m)]):  # the first group's first column tile
        assert (m, n) == (first, 0)
    groups = [m // group_m for m, _ in got]
    assert groups == sorted(groups)  # a group's tiles all run before the next group's


def test_rejects_mismatched_scales(device):
    xq, xs = _acts((4, 256), device)
    w, ws = _weights(1, 128, 256, device)
    with pytest.raises(ValueError, match="scale"):
        G.fp8_gemm(xq, xs, w[0], ws[0, :, :1])
    with pytest.raises(ValueError, match="float8"):
        G.fp8_gemm(xq, xs, w[0].float(), ws[0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m,n,k", [(256, 4096, 7168), (7, 576, 7168), (300, 7168, 2048)])
def test_dense_real_shapes_on_gpu(m, n, k):
    xq, xs = _acts((m, k), "cuda")
    w, ws = _weights(1, n, k, "cuda")
    assert _rel(G.fp8_gemm(xq, xs, w[0], ws[0]), G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_masked_real_shapes_on_gpu():
    xq, xs = _acts((4, 512, 7168), "cuda")
    w, ws = _weights(4, 4096, 7168, "cuda")
    counts = torch.tensor([512, 300, 1, 257], dtype=torch.int32, device="cuda")
    out = G.fp8_gemm_masked(xq, xs, w, ws, counts)
    for e, c in enumerate(counts.tolist()):
        ref = G.fp8_gemm_reference(xq[e, :c], xs[e, :c], w[e], ws[e])
        assert _rel(out[e, :c], ref) < 1e-2


def test_split_k_sums_every_slice(device):
    xq, xs = _acts((20, 1024), device)
    w, ws = _weights(1, 256, 1024, device)
    ref = G.fp8_gemm_reference(xq, xs, w[0], ws[0])
    for split in (2, 3):  # 8 K blocks: 3 slices of 3, 3, 2
        assert _rel(G.fp8_gemm(xq, xs, w[0], ws[0], split_k=split), ref) < 1e-2


def test_split_k_slices_sum_in_a_fixed_order(device):
    """Each slice's partial lands in its own plane and the planes are summed in order: the result is the
    sum of the K slices' own GEMMs, also where the last slice is empty (8 K blocks in 5 slices of 2)."""
    xq, xs = _acts((20, 1024), device)
    w, ws = _weights(1, 256, 1024, device)
    for split in (3, 5):
        per = -(-8 // split) * 128
        parts = [
            G.fp8_gemm(xq[:, k0 : k0 + per], xs[:, k0 // 128 : (k0 + per) // 128], w[0][:, k0 : k0 + per],
                       ws[0][:, k0 // 128 : (k0 + per) // 128], out_dtype=torch.float32, split_k=1)
            for k0 in range(0, 1024, per)
        ]  # fmt: skip
        want = torch.stack(parts + [torch.zeros_like(parts[0])] * (split - len(parts))).sum(0)
        got = G.fp8_gemm(xq, xs, w[0], ws[0], out_dtype=torch.float32, split_k=split)
        assert _rel(got, want) < 1e-5, split  # the slices' own GEMMs may tile K blocks in another order


@pytest.mark.skipif(not HAS_CUDA, reason="atomic order varies only on a GPU")
def test_split_k_is_deterministic_on_the_gpu():
    """Many slices of a decode-sized GEMM, run again and again: bitwise the same every time (atomic adds
    into one fp32 C were not, and greedy tokens of the random-weight test model followed)."""
    xq, xs = _acts((4, 7168), "cuda")
    w, ws = _weights(1, 2112, 7168, "cuda")
    for split in (4, 7, 14):
        runs = [G.fp8_gemm(xq, xs, w[0], ws[0], split_k=split) for _ in range(30)]
        assert all(torch.equal(r, runs[0]) for r in runs), split


def test_split_k_choice():
    assert G.split_k_for(256, 4096, 7168) > 1
    assert G.split_k_for(4096, 24576, 1536) == 1
