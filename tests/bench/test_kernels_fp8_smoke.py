"""bench.kernels' FP8-cache MLA comparison at a toy size on CPU under Triton's interpreter: every kernel runs
on the same values and is checked, the best FP8 config is chosen and carries its speedups. Times nothing."""

from __future__ import annotations

import pytest

from tests.libs.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real benchmark")


def test_fp8_case_records_every_kernel_on_the_same_values(monkeypatch: pytest.MonkeyPatch):
    import bench.kernels as K
    from libs.kernels.mla_decode import MLAConfig

    monkeypatch.setattr(K, "bench_ms", lambda fn: (fn(), 1.0)[1])  # run once, "1 ms"
    monkeypatch.setattr(K, "MLAConfig", lambda: MLAConfig(16, 16, 4, 1))
    recs = K.mla_fp8_case(2, 20, 16, None, lambda _: None, device="cpu", sweep=[MLAConfig(16, 32, 4, 1)])
    by = {(r["backend"], r.get("sweep")): r for r in recs}
    assert by[("triton-bf16", None)]["rel_err_vs_exact"] < 1e-2
    narrow = by[("triton-bf16", True)]  # the same kernel at 32-row tiles, the same values
    assert narrow["config"]["block_n"] == 32 and narrow["rel_err_vs_exact"] < 1e-2
    for dots in ("fp8", "fp8-qk", "bf16"):  # one best record per product mode
        best = by[(f"triton-{dots}-dots", False)]
        assert best["kv_cache"] == "fp8_e4m3" and best["dots"] == dots and best["speedup_vs_triton-bf16"] == 1.0
        assert best["rel_err_vs_exact"] < (1e-2 if dots == "bf16" else 1e-1), dots
        assert best["GBps"] < by[("triton-bf16", None)]["GBps"]  # 656 bytes a row against 1,152, same time
    assert by[("triton-fp8-dots", False)]["rel_err_vs_q8_reference"] < 2e-2


def test_fp8_case_times_only_the_dots_modes_asked_for(monkeypatch: pytest.MonkeyPatch):
    """`--triton-fp8 engine`: the Engine's product mode only, no other mode compiled or timed."""
    import bench.kernels as K
    from libs.kernels.mla_decode import MLAConfig

    monkeypatch.setattr(K, "bench_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(K, "MLAConfig", lambda: MLAConfig(16, 16, 4, 1))
    recs = K.mla_fp8_case(
        2, 20, 16, None, lambda _: None, device="cpu", sweep=[MLAConfig(16, 32, 4, 1)], dots_modes=("bf16",)
    )
    assert {r.get("dots") for r in recs if r["kv_cache"] == "fp8_e4m3"} == {"bf16"}
    assert [r["backend"] for r in recs if r.get("sweep") is False] == ["triton-bf16-dots"]
