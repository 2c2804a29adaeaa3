"""FP8 GEMM kernel choices keyed by a bucket of M: in the tune step one sweep per bucket (not per exact M),
the fastest candidate kept; while serving a shape without a table entry takes a fixed default and nothing is
timed; outputs unchanged either way. The GPU timing is faked (graph_time); the kernels run on the GPU where
there is one, else under Triton's interpreter on the CPU (the kernel conftest), with the Triton kernel's
sweep alone (MOEMESH_FP8_GEMM=triton: no Gluon candidates on SM90 either)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels import fp8_gemm as G  # noqa: E402
from libs.kernels import gemm_tuning  # noqa: E402
from libs.kernels.quant import quant_fp8_groups  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where Triton runs (the conftest's interpreter)


@pytest.fixture
def fresh(monkeypatch) -> None:
    """Fresh choice caches and the choosing path on (as on a GPU), Triton candidates only."""
    for name in ("_TRITON_CONFIG", "_KERNEL_CHOICE", "_SPLIT_CHOICE"):
        monkeypatch.setattr(G, name, {})
    for name in ("TIMINGS", "REJECTED", "DEFAULTED"):
        monkeypatch.setattr(gemm_tuning, name, {})
    monkeypatch.setattr(G, "_on_gpu", lambda: True)
    monkeypatch.setenv("MOEMESH_FP8_GEMM", "triton")  # the sweeps below count the Triton candidates only


@pytest.fixture
def timed(fresh, monkeypatch, tmp_path) -> Iterator[list[int]]:
    """Inside the tune step, with a fake clock: each timing call returns a smaller time than the one before,
    so the last candidate of a sweep wins; -> the calls, one per timing."""
    calls: list[int] = []

    def fake_time(fn) -> float:
        calls.append(1)
        return 1000.0 - len(calls)

    monkeypatch.setattr(gemm_tuning, "graph_time", fake_time)
    with gemm_tuning.tuning(tmp_path / "tuned"):
        yield calls


def _weights(e, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) * 2).to(G.FP8)
    return w.to(DEVICE), (torch.rand(e, -(-n // 128), k // 128, generator=g) * 0.02 + 0.005).to(DEVICE)


def _acts(shape, seed=1):
    return quant_fp8_groups(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_m_bucket():
    rows = (1, 2, 3, 5, 16, 17, 1000, 2000)
    assert [gemm_tuning.m_bucket(m) for m in rows] == [1, 2, 4, 8, 16, 32, 1024, 2048]
    powers = [2**i for i in range(13)]  # decode graph sizes keep a bucket each
    assert [gemm_tuning.m_bucket(p) for p in powers] == powers
    assert {gemm_tuning.m_bucket(m) for m in (4097, 8192, 16384, 123_457)} == {gemm_tuning.M_BUCKET_MAX}
    with pytest.raises(ValueError, match="at least one row"):
        gemm_tuning.m_bucket(0)


def test_rows_of_one_bucket_share_one_tuning_and_stay_correct(timed):
    w, ws = _weights(1, 128, 256)  # K = 2 blocks: split_k_for says 1, so only the tile sweep is timed
    timings = 0
    for m, new_bucket in ((20, True), (27, False), (32, False), (40, True)):
        xq, xs = _acts((m, 256), seed=m)
        out = G.fp8_gemm(xq, xs, w[0], ws[0])
        assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2
        timings += len(G.configs_for(m)) if new_bucket else 0
        assert len(timed) == timings, m
    assert set(G._TRITON_CONFIG) == {(G.DENSE, 32, 128, 256, 1), (G.DENSE, 64, 128, 256, 1)}
    assert all(cfg is G._CONFIGS[-1] for cfg in G._TRITON_CONFIG.values())  # the fake clock's fastest
    assert set(G._KERNEL_CHOICE) == set(G._TRITON_CONFIG)  # no Gluon candidates off SM90: Triton, untimed


def test_masked_layout_tunes_per_bucket_of_rows_per_expert(timed):
    w, ws = _weights(2, 128, 256)
    counts = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    for m_max in (9, 13):
        xq, xs = _acts((2, m_max, 256), seed=m_max)
        out = G.fp8_gemm_masked(xq, xs, w, ws, counts)
        ref = G.fp8_gemm_reference(xq, xs, w, ws)
        for e, c in enumerate(counts.tolist()):
            assert _rel(out[e, :c], ref[e, :c]) < 1e-2
    assert len(timed) == len(G.configs_for(16))
    assert list(G._TRITON_CONFIG) == [(G.MASKED, 16, 128, 256, 2)]


def test_split_k_is_chosen_once_per_bucket(timed):
    w, ws = _weights(1, 128, 2048)  # 16 K blocks: small M asks for split-K
    assert G.split_k_for(3, 128, 2048) > 1
    for m in (3, 4):
        xq, xs = _acts((m, 2048), seed=m)
        out = G.fp8_gemm(xq, xs, w[0], ws[0])
        assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2
    assert list(G._SPLIT_CHOICE) == [("split", G.DENSE, 4, 128, 2048, 1)]
    assert G._SPLIT_CHOICE[("split", G.DENSE, 4, 128, 2048, 1)] > 1  # the fake clock's last candidate


def test_timing_is_fenced_from_queued_work(monkeypatch):
    """The graph timing of candidate kernels runs on a side stream: it must start only after everything
    queued on the caller's stream finished (a candidate's write to `out` could otherwise land in memory a
    queued kernel still reads: NaN tiles in a float32 matmul on the H200) and end before the caller goes on."""
    import triton.testing

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))

    def bench(fn, **kw):
        events.append("bench")
        fn()
        return 1.5

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", bench)
    assert gemm_tuning.graph_time(lambda: events.append("kernel")) == 1.5
    assert events == ["sync", "bench", "kernel", "sync"]


@pytest.mark.parametrize("cfg", G._CONFIGS, ids=str)
def test_every_tuning_candidate_computes_the_gemm(monkeypatch, cfg):
    """Whichever tile config the sweep keeps, the launch built from it gives the right product (ragged N: a
    64-wide tile inside a 128-wide weight-scale block)."""
    monkeypatch.setattr(G, "_on_gpu", lambda: True)
    key = G.tuning_key(G.DENSE, 40, 192, 256, 1)
    monkeypatch.setattr(G, "_TRITON_CONFIG", {key: cfg})
    monkeypatch.setattr(G, "_KERNEL_CHOICE", {key: None})
    monkeypatch.setattr(G, "_SPLIT_CHOICE", {("split", *key): 1})
    w, ws = _weights(1, 192, 256)
    xq, xs = _acts((40, 256))
    out = G.fp8_gemm(xq, xs, w[0], ws[0])
    assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2


def test_the_sweep_keeps_row_tiles_that_fit_the_bucket():
    heights = {
        b: sorted({c.kwargs["BLOCK_M"] for c in G.configs_for(b)})
        for b in (1, 16, 32, 64, 128, 256, 512, 9999)
    }
    assert heights == {
        1: [16],
        16: [16],
        32: [16, 32],
        64: [16, 32, 64],
        128: [32, 64, 128],
        256: [32, 64, 128],
        512: [64, 128],
        9999: [64, 128],
    }
    assert sum(len(G.configs_for(1 << i)) for i in range(13)) == 56
    assert all(c in G._CONFIGS for b in heights for c in G.configs_for(b))


def test_contiguous_layout_tunes_all_but_its_row_tile(timed):
    """Prefill's grouped GEMM: rows padded per expert to block_m, so only configs of that row tile compete,
    once per bucket of M (keyed with block_m); padding tiles stay untouched and each tile uses its expert."""
    w, ws = _weights(3, 128, 256)
    tile_expert = torch.tensor([2, 2, -1, 0], dtype=torch.int32, device=DEVICE)
    with_tile_16 = [c for c in G._CONFIGS if c.kwargs["BLOCK_M"] == 16]
    for seed in (1, 2):
        xq, xs = _acts((64, 256), seed=seed)
        out = torch.full((64, 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        G.fp8_gemm_contiguous(xq, xs, w, ws, tile_expert, 16, out=out)
        ref = G.fp8_gemm_reference(xq, xs, w, ws)
        for t, e in enumerate(tile_expert.tolist()):
            rows = slice(16 * t, 16 * (t + 1))
            assert out[rows].isnan().all() if e < 0 else _rel(out[rows], ref[e, rows]) < 1e-2
    assert len(timed) == len(with_tile_16)  # the second call reused the bucket's choice
    assert {(G.CONTIGUOUS, 64, 128, 256, 1, 16): with_tile_16[-1]} == G._TRITON_CONFIG


def test_serving_takes_fixed_defaults_and_times_nothing(fresh, monkeypatch):
    """No table entry, no tune step: each shape takes its default (a candidate of its own bucket, the
    split-K heuristic's factor), graph_time is never called, and the product is right."""

    def no_timing(fn):
        raise AssertionError("graph_time called while serving")

    monkeypatch.setattr(gemm_tuning, "graph_time", no_timing)
    for m, k in ((3, 2048), (40, 256)):  # split-K by default; one K loop through a default tile
        w, ws = _weights(1, 128, k)
        xq, xs = _acts((m, k), seed=m)
        out = G.fp8_gemm(xq, xs, w[0], ws[0])
        assert _rel(out, G.fp8_gemm_reference(xq, xs, w[0], ws[0])) < 1e-2
    assert {
        ("split", G.DENSE, 4, 128, 2048, 1): G.split_k_for(4, 128, 2048),
        ("split", G.DENSE, 64, 128, 256, 1): 1,
    } == G._SPLIT_CHOICE
    assert G.split_k_for(4, 128, 2048) > 1
    assert {(G.DENSE, 64, 128, 256, 1): G.default_config(64)} == G._TRITON_CONFIG
    assert G.default_config(64) in G.configs_for(64)
    assert gemm_tuning.DEFAULTED and not gemm_tuning.TIMINGS


def test_default_configs_are_candidates_of_their_bucket_and_fixed():
    for i in range(13):
        b = 1 << i
        assert G.default_config(b) in G.configs_for(b)
        assert G.default_config(b) is G.default_config(b)  # one object: the same text in every process
    for bm in (16, 32, 64, 128):
        cfg = G.default_config(4096, block_m=bm)
        assert cfg.kwargs["BLOCK_M"] == bm and cfg in G._CONFIGS


def test_a_wrong_candidate_is_never_chosen_however_fast(fresh, monkeypatch, tmp_path):
    """In the tune step each candidate's output is checked against the first working candidate's before it
    is timed: one that writes a wrong product, or rows it should leave alone, is rejected even when it times
    fastest (numerics never follow a timing); a close one competes; the caller's buffer holds after the
    sweep what it held before."""
    out = torch.full((4, 8), float("nan"))  # rows 2-3: left alone by every right candidate
    product = torch.arange(16.0).view(2, 8)

    def run(cand: str) -> None:
        if cand == "fails":
            raise RuntimeError("out of shared memory")
        out[:2] = product * {"wrong": 1.5, "close": 1.0001}.get(cand, 1.0)
        if cand == "outside":
            out[3] = 0.0

    times = {"right": 3.0, "fails": 0.1, "close": 2.0, "wrong": 0.5, "outside": 0.4}
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: times[fn.args[0]])
    with gemm_tuning.tuning(tmp_path / "tuned"):
        chosen = gemm_tuning.fastest(("key",), list(times), run, "kernel_choice", out)
    assert chosen == "close"
    assert {cand for _, cand in gemm_tuning.REJECTED} == {"fails", "wrong", "outside"}
    assert "differs from candidate right's" in gemm_tuning.REJECTED[(("key",), "wrong")]
    assert out.isnan().all()
