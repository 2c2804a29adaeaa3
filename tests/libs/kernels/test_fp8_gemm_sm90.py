"""The Gluon SM90 FP8 block-scaled GEMM: every config compiles for sm_90a here (no GPU needed: Triton's
bundled ptxas), with no register spills where we count on none; on a Hopper GPU every config and
layout equals the dequantize-then-multiply reference, including split-K, ragged edges and skipped tiles."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from bench.kernel_resources import fp8_gemm_sm90, wgmma_serialized  # noqa: E402
from libs.kernels import fp8_gemm as G  # noqa: E402
from libs.kernels import fp8_gemm_sm90 as S  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402
from .test_fp8_gemm import _acts, _rel, _weights  # noqa: E402

IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("cfg", S.CONFIGS, ids=str)
def test_every_config_compiles_for_sm90_with_async_mma(cfg):
    for layout, split in [(S.DENSE, 1), (S.MASKED, 1), (S.CONTIGUOUS, 1), (S.DENSE, 4)]:
        compiled = fp8_gemm_sm90(cfg, layout, split)
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
        if cfg[4] > 1:  # overlapped promotion: an MMA stays in flight while the previous one is promoted
            assert "wgmma.wait_group.sync.aligned 1;" in ptx
        if layout == S.MASKED:  # decode's layout: ptxas keeps its WGMMAs asynchronous (one ptxas run a config)
            assert not wgmma_serialized(compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", S.CONFIGS, ids=str)
@pytest.mark.parametrize("m,n,k", [(256, 2112, 7168), (100, 4096, 2048), (512, 1536, 512)])
def test_dense_every_config_on_gpu(cfg, m, n, k):
    if (k // 128) % cfg[4]:
        pytest.skip("K blocks not a multiple of the unroll")
    xq, xs = _acts((m, k), "cuda")
    w, ws = _weights(1, n, k, "cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G._launch_sm90(xq[None], xs[None], w, ws, out[None], m, xs, xs, S.DENSE, 1, cfg)
    assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", S.CONFIGS, ids=str)
def test_masked_every_config_writes_only_counted_rows(cfg):
    assert_masked_writes_only_counted_rows(
        lambda xq, xs, w, ws, out, m_max, counts, e: G._launch_sm90(
            xq, xs, w, ws, out, m_max, counts, counts, S.MASKED, e, cfg
        )
    )


def assert_masked_writes_only_counted_rows(launch):
    """launch(xq, xs, w, ws, out, m_max, counts, experts) as a masked GEMM over 5 experts with 0, 1, 130, 512
    and 64 rows: each expert's counted rows are its product, the rest of `out` untouched (NaN)."""
    e, m_max, n, k = 5, 512, 4096, 7168
    xq, xs = _acts((e, m_max, k), "cuda")
    w, ws = _weights(e, n, k, "cuda")
    counts = torch.tensor([0, 1, 130, 512, 64], dtype=torch.int32, device="cuda")
    out = torch.full((e, m_max, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch(xq, xs, w, ws, out, m_max, counts, e)
    for i, c in enumerate(counts.tolist()):
        assert out[i, c:].isnan().all()
        if c:
            ref = G.fp8_gemm_reference(xq[i, :c], xs[i, :c], w[i], ws[i])
            assert _rel(out[i, :c], ref) < 1e-2


def _assert_each_tile_is_its_experts(out, xq, xs, w, ws, tile_expert, bm):
    """Each bm-row tile of `out` is its expert's product; a padding tile (-1) stays NaN."""
    for t, ex in enumerate(tile_expert.tolist()):
        rows = slice(bm * t, bm * (t + 1))
        if ex < 0:
            assert out[rows].isnan().all()
        else:
            assert _rel(out[rows], G.fp8_gemm_reference(xq[rows], xs[rows], w[ex], ws[ex])) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", S.CONFIGS, ids=str)
def test_contiguous_uses_each_tiles_expert(cfg):
    bm, k, n = cfg[0], 2048, 7168  # row tiles of the config's height (the layout's padding)
    tile_expert = torch.tensor([2, 2, -1, 0, 1], dtype=torch.int32, device="cuda")
    xq, xs = _acts((bm * 5, k), "cuda")
    w, ws = _weights(3, n, k, "cuda")
    out = torch.full((bm * 5, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G._launch_sm90(
        xq[None], xs[None], w, ws, out[None], bm * 5, tile_expert, tile_expert, S.CONTIGUOUS, 1, cfg
    )
    _assert_each_tile_is_its_experts(out, xq, xs, w, ws, tile_expert, bm)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", [c for c in S.CONFIGS if c[1] == 128][:2] + [(128, 256, 8, 3, 1)], ids=str)
@pytest.mark.parametrize("group_m", [1, 3, None])
def test_contiguous_program_groups_cover_every_tile(cfg, group_m):
    """Row tiles in groups of group_m (a last group partial) over 11 tiles of 4 experts: every tile
    computed once with its own expert, whatever the program order."""
    bm, k, n = cfg[0], 512, 1024
    tile_expert = torch.tensor([0, 0, 1, 3, 3, 3, -1, 2, 2, 1, 0], dtype=torch.int32, device="cuda")
    tiles = tile_expert.numel()
    xq, xs = _acts((bm * tiles, k), "cuda")
    w, ws = _weights(4, n, k, "cuda")
    out = torch.full((bm * tiles, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    S.launch(
        xq, xs[None], w.reshape(4 * n, k), ws, out[None], bm * tiles, n, k, tile_expert, tile_expert,
        S.CONTIGUOUS, 1, cfg, group_m=group_m or G.group_m_for(bm),
    )  # fmt: skip
    _assert_each_tile_is_its_experts(out, xq, xs, w, ws, tile_expert, bm)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("split", [2, 4, 7, 8])
def test_split_k_on_gpu(split):
    m, n, k = 256, 2112, 7168
    xq, xs = _acts((m, k), "cuda")
    w, ws = _weights(1, n, k, "cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    G._fp8_gemm_split_k(xq, xs, w[0], ws[0], out, split)
    assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
def test_public_entry_points_pick_a_kernel_and_stay_correct():
    """fp8_gemm takes its split-K factor and then its kernel from the table or the fixed defaults on first use
    (never a timing while serving); whatever it takes must not change the answer."""
    xq, xs = _acts((256, 7168), "cuda")
    w, ws = _weights(1, 4096, 7168, "cuda")
    for _ in range(2):
        out = G.fp8_gemm(xq, xs, w[0], ws[0])
        assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2
    key = G.tuning_key(G.DENSE, 256, 4096, 7168, 1)
    split = G._SPLIT_CHOICE[("split", *key)]
    assert split >= 1 and (split > 1 or key in G._KERNEL_CHOICE)  # one K loop: a kernel was chosen for it
