"""bench.kernel_resources on this CPU machine: kernels compiled for sm_90 with Triton's own ptxas, their
registers, spills and MMA instructions read back from the cubin."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from bench.kernel_resources import compile_sm90, quant_rows, resources  # noqa: E402


@triton.jit
def _dot64(A, B, C, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(A + r[:, None] * BLOCK + r[None, :])
    b = tl.load(B + r[:, None] * BLOCK + r[None, :])
    tl.store(C + r[:, None] * BLOCK + r[None, :], tl.dot(a, b))


def test_a_bf16_dot_gets_wgmma_and_no_spills():
    r = resources(compile_sm90(_dot64, {"A": "*bf16", "B": "*bf16", "C": "*fp32"}, {"BLOCK": 64}))
    assert any(k.startswith("HGMMA.64x64x16.F32.BF16") for k in r.mma), r.mma  # Hopper's wgmma, not mma.sync
    assert r.spill_instructions == 0 and r.stack_bytes == 0
    assert 0 < r.registers <= 255 and r.shared_bytes > 0


def test_the_quantization_kernel_has_no_mma_and_no_spills():
    r = quant_rows()
    assert r.mma == {} and r.spill_instructions == 0 and 0 < r.registers < 128
