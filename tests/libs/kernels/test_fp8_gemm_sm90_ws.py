"""The persistent warp-specialized Gluon FP8 GEMM: every config compiles for sm_90a here (Triton's bundled
ptxas) as two consumer warpgroups and a TMA producer with asynchronous WGMMAs; on a Hopper GPU each layout equals
the dequantize-then-multiply reference, including experts with no rows, ragged counts and padding tiles, with
fewer programs than tiles."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from bench.kernel_resources import fp8_gemm_ws, wgmma_serialized  # noqa: E402
from libs.kernels import fp8_gemm as G  # noqa: E402
from libs.kernels import fp8_gemm_sm90 as S  # noqa: E402
from libs.kernels import fp8_gemm_sm90_ws as W  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402
from .test_fp8_gemm import _acts, _rel, _weights  # noqa: E402
from .test_fp8_gemm_sm90 import _assert_each_tile_is_its_experts, assert_masked_writes_only_counted_rows  # noqa: E402

IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("cfg", W.CONFIGS, ids=str)
def test_every_config_compiles_for_sm90_as_consumers_and_a_producer(cfg):
    for layout in (S.DENSE, S.MASKED, S.CONTIGUOUS):
        compiled = fp8_gemm_ws(cfg, layout)
        ptx = compiled.asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx  # the producer's TMA
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # a consumer's 64 rows
        assert "wgmma.wait_group.sync.aligned 1;" in ptx  # a block's promotion while the next one's MMA runs
        assert re.search(r"setmaxnreg.dec[.a-z0-9]+\s+24;", ptx)  # the producer's registers go to the consumers
        assert re.findall(r"bar.sync\s+(\d+), 128;", ptx) and not re.search(r"bar.sync\s+\d+;", ptx)
        assert compiled.metadata.shared <= 232448
        assert not wgmma_serialized(compiled)


def test_refuses_shapes_its_config_does_not_tile():
    a = torch.zeros(128, 384, dtype=torch.uint8)
    with pytest.raises(ValueError, match="divisible"):
        W.launch(a, None, a, None, None, 128, 128, 384, None, None, S.DENSE, 1, (128, 6, 2), group_m=8)


def _launch(xq, xs, w, ws, out, m, counts, tile_expert, layout, grid_e, cfg, group_m=8):
    e, n, k = w.shape
    W.launch(xq.reshape(-1, k), xs, w.reshape(e * n, k), ws, out, m, n, k, counts, tile_expert, layout, grid_e, cfg,
             a_rows_per_expert=xq.shape[1], group_m=group_m)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", W.CONFIGS, ids=str)
@pytest.mark.parametrize("m,n,k", [(256, 2048, 7168), (100, 4096, 2048), (1024, 1536, 512)])
def test_dense_on_gpu(cfg, m, n, k):
    if (k // 128) % cfg[2]:
        pytest.skip("K blocks not a multiple of the unroll")
    xq, xs = _acts((m, k), "cuda")
    w, ws = _weights(1, n, k, "cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _launch(xq[None], xs[None], w, ws, out[None], m, xs, xs, S.DENSE, 1, cfg)
    assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", W.CONFIGS, ids=str)
def test_masked_writes_only_counted_rows(cfg):
    assert_masked_writes_only_counted_rows(
        lambda xq, xs, w, ws, out, m_max, counts, e: _launch(xq, xs, w, ws, out, m_max, counts, counts, S.MASKED, e, cfg)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("cfg", W.CONFIGS, ids=str)
def test_contiguous_uses_each_tiles_expert(cfg):
    k, n = 2048, 7168
    tile_expert = torch.tensor([2, 2, -1, 0, 1, 1, 0], dtype=torch.int32, device="cuda")
    tiles = tile_expert.numel()
    xq, xs = _acts((128 * tiles, k), "cuda")
    w, ws = _weights(3, n, k, "cuda")
    out = torch.full((128 * tiles, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _launch(xq[None], xs[None], w, ws, out[None], 128 * tiles, tile_expert, tile_expert, S.CONTIGUOUS, 1, cfg)
    _assert_each_tile_is_its_experts(out, xq, xs, w, ws, tile_expert, 128)
