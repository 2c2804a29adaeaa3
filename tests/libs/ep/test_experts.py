"""A rank's FP8 experts through the grouped GEMMs (Triton's interpreter on CPU) in both dispatch layouts,
against the plain-torch FP8 reference; expert load counted by scatter-add."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from libs.ep.dispatch.base import Dispatched
from libs.ep.experts import count_load, run_fp8_experts
from libs.kernels.backend import fp8_moe_reference

pytest.importorskip("triton")

S, D, I, K = 3, 256, 128, 2


def experts(device: str) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        gate_up_proj=torch.randn(S, 2 * I, D, generator=g).to(torch.float8_e4m3fn).to(device),
        gate_up_proj_scale_inv=(torch.rand(S, 2 * I // 128, D // 128, generator=g) * 0.01 + 0.01).to(device),
        down_proj=torch.randn(S, D, I, generator=g).to(torch.float8_e4m3fn).to(device),
        down_proj_scale_inv=(torch.rand(S, D // 128, I // 128, generator=g) * 0.01 + 0.01).to(device),
    )


def weights(ex):
    return (ex.gate_up_proj, ex.gate_up_proj_scale_inv), (ex.down_proj, ex.down_proj_scale_inv)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_tokens_layout_rows_with_picks_elsewhere_equal_the_reference(device: str) -> None:
    ex = experts(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, D, generator=g).to(torch.float16).to(device)
    ids = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 0], [1, 2]], device=device)  # -1: on another rank
    w = torch.rand(5, K, generator=g).to(device)
    got = run_fp8_experts(ex, Dispatched("tokens", x, ids, w))
    want = fp8_moe_reference(x, ids, w, *weights(ex))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert (got[2] == 0).all()  # a row none of whose experts is here


def test_experts_layout_runs_each_expert_on_its_counted_rows_unweighted(device: str) -> None:
    ex = experts(device)
    g = torch.Generator().manual_seed(2)
    cap = 4
    x = torch.randn(S, cap, D, generator=g).to(torch.float16).to(device)
    counts = [2, 0, 4]
    got = run_fp8_experts(ex, Dispatched("experts", x, counts=counts))
    for e, n in enumerate(counts):
        ids = torch.full((n, 1), e, device=device)
        want = fp8_moe_reference(x[e, :n], ids, torch.ones(n, 1, device=device), *weights(ex))
        torch.testing.assert_close(got[e, :n].float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (got[e, n:] == 0).all()


def test_count_load_adds_every_pick_once() -> None:
    load = torch.zeros(4, dtype=torch.int64)
    count_load(load, torch.tensor([[0, 3], [3, 1]]))
    count_load(load, torch.tensor([[3, 2]]))
    assert load.tolist() == [1, 1, 1, 3]
