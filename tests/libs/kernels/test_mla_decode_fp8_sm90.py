"""The Gluon SM90 FP8 MLA decode, each schedule (pipelined, the warp-specialized seesaw): it compiles for
sm_90a here (no GPU needed: Triton's bundled ptxas) with QK and PV as FP8 WGMMAs fed by TMA; on a Hopper GPU it
matches the float32 reference of the same math (the Triton FP8 kernel's), over pages in any order, ragged ends,
splits, and stale NaN bytes past a sequence."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from bench.kernel_resources import mla_fp8_sm90, wgmma_serialized  # noqa: E402
from libs.kernels import mla_decode_fp8_sm90 as S  # noqa: E402
from libs.kernels import mla_decode_fp8_sm90_seesaw as W  # noqa: E402
from libs.kernels.mla_decode import MLAConfig, choose_num_splits, mla_decode_reference  # noqa: E402
from libs.kernels.mla_decode_fp8 import dequantize_rows  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402
from .test_mla_decode_fp8 import _case, _ref, _rel  # noqa: E402

IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
KERNELS = {"pipelined": S.mla_decode_fp8_sm90, "seesaw": W.mla_decode_fp8_sm90_seesaw}  # each schedule


@pytest.mark.parametrize("direct", [True, False])
def test_compiles_for_sm90_with_fp8_wgmma_for_qk_and_pv(direct):
    compiled = mla_fp8_sm90("pipelined", direct)
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx  # the pages arrive by TMA
    assert "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3" in ptx  # QK over the codes
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in ptx  # PV: each warpgroup half of V
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # the softmax runs while the last tile's PV does
    assert compiled.metadata.shared <= 232448  # an SM90 block's shared memory
    assert not wgmma_serialized(compiled)  # ptxas keeps the WGMMAs asynchronous


@pytest.mark.parametrize("direct", [True, False])
def test_seesaw_compiles_for_sm90_as_two_warpgroups_and_a_producer(direct):
    ptx = (compiled := mla_fp8_sm90("seesaw", direct)).asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx  # the producer's TMA
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx  # a warpgroup's whole 64 x 64 QK
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in ptx  # PV on its half of the output
    # registers moved from the producer's warpgroup to the consumers'
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+240;", ptx) and re.search(r"setmaxnreg.dec[.a-z0-9]+\s+24;", ptx)
    # each partition's barriers count only its own 128 threads (a block-wide one would deadlock the others)
    assert re.findall(r"bar.sync\s+(\d+), 128;", ptx) and not re.search(r"bar.sync\s+\d+;", ptx)
    assert compiled.metadata.shared <= 232448
    assert not wgmma_serialized(compiled)  # no WGMMA result in flight through a branch or read early


def _run(q, kv, table, seq, kernel="pipelined", **kw):
    return KERNELS[kernel](q[..., :512], kv, table, seq, 64, 0.1352, q_rope=q[..., 512:], **kw)


def test_refuses_what_it_does_not_read(device):
    q, kv, table, seq = _case(device, 16, 64, [70])
    for kernel in KERNELS:
        with pytest.raises(ValueError, match="heads in 64s"):
            _run(q, kv, table, seq, kernel)
    q, kv, table, seq = _case(device, 64, 64, [70])
    with pytest.raises(ValueError, match="uint8 rows"):
        _run(q, dequantize_rows(kv).to(q.dtype), table, seq, "seesaw")


def test_available_only_on_sm90_for_its_pages_and_heads(monkeypatch):
    assert not S.available(torch.device("cpu"), 64, 128)
    if IS_SM90:
        dev = torch.device("cuda")
        assert S.available(dev, 64, 128) and not S.available(dev, 16, 128) and not S.available(dev, 64, 16)
        monkeypatch.setenv("MOEMESH_MLA_FP8", "triton")
        assert not S.available(dev, 64, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", [128, 64])
def test_matches_the_reference_on_gpu(kernel, heads):
    lens = [2048, 1, 3000, 517, 64, 2100, 1999, 8, 65]
    q, kv, table, seq = _case("cuda", heads, 64, lens, seed=3, row_spread=2.0)
    ref = _ref(q, kv, table, seq, 64, 0.1352)
    exact = mla_decode_reference(q.float(), dequantize_rows(kv), table, seq, 64, 0.1352)
    for splits in sorted({1, 3, choose_num_splits(len(lens), heads, 3000, MLAConfig())}):
        out = torch.full((len(lens), heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        _run(q, kv, table, seq, kernel, num_splits=splits, out=out)
        # beyond the reference's rounding of q: the FP8 probabilities and the bf16 output (as the Triton kernel)
        assert _rel(out, ref) < 1.5e-2, splits
        # against exact attention: mostly the FP8 query's rounding (measured 0.13-0.21 at this row spread)
        assert _rel(out, exact) < 3e-1, splits


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("kernel", KERNELS)
def test_stale_nan_bytes_past_the_end_and_empty_splits_stay_out(kernel):
    q, kv, table, seq = _case("cuda", 128, 64, [20, 130], seed=1)
    nan_rows = kv.clone()
    for b, n in enumerate(seq.tolist()):  # every slot past each sequence's end: NaN codes, a 3.4e38 scale
        last = table[b, (n - 1) // 64].long()
        nan_rows[last * 64 + (n % 64 or 64) : last * 64 + 64] = 0x7F
    out = _run(q, nan_rows, table, seq, kernel, num_splits=8)  # most of 8 splits of 20 rows: empty
    assert out.isfinite().all()
    assert _rel(out, _ref(q, kv, table, seq, 64, 0.1352)) < 1.5e-2
