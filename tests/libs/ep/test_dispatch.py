"""Dispatch -> local experts -> combine over the in-process hub (threads as ranks) against the dense MoE."""

from __future__ import annotations

import pytest
import torch

from libs.ep.comm import InProcessHub
from libs.ep.dispatch.all_to_all import AllToAllDispatcher
from libs.ep.dispatch.base import quantize_for_dispatch
from libs.ep.dispatch.factory import make_dispatcher
from libs.ep.experts import expert_mlp, run_local_experts
from libs.ep.placement import Placement
from libs.quant.fp8 import dequantize_fp8_groups
from tests.libs.ep.inprocess import run_ranks

E, D, I, K = 16, 128, 32, 4


def experts_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.empty(0, K).long()
    )
    return x, ids, torch.rand(t, K, generator=g)


def dense(x, ids, w, gate_up, down) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            out[t] += w[t, k] * expert_mlp(gate_up[e], down[e], x[t : t + 1])[0]
    return out


def ep_moe(placement: Placement, tokens: list[int], fp8: bool = False, active: list[bool] | None = None):
    gate_up, down = experts_weights()
    hub = InProcessHub(placement.ep_size)
    active = active or [True] * placement.ep_size

    def rank(r: int):
        comm = hub.comm(r)
        disp = AllToAllDispatcher(comm, placement.slots_per_rank, fp8=fp8)
        local = placement.local_experts(r)[0]
        x, ids, w = routing(tokens[r], seed=r)
        slots = placement.to_physical(0, ids, r)
        d = disp.dispatch(x, slots, w, active=active[r])
        assert d is not None
        out = disp.combine(run_local_experts(gate_up[local], down[local], d), d)
        assert disp.dispatch(x[:0], slots[:0], w[:0], active=False) is None  # nobody active: round over
        return x, ids, w, out

    return run_ranks(placement.ep_size, rank), gate_up, down


@pytest.mark.parametrize(
    ("ranks", "redundant", "tokens"),
    [(2, 0, [5, 9]), (4, 0, [1, 7, 3, 12]), (2, 2, [6, 11]), (4, 4, [8, 2, 5, 9])],
    ids=["2-ranks", "4-ranks", "2-ranks-redundant", "4-ranks-redundant"],
)
def test_ep_moe_equals_the_dense_moe(ranks: int, redundant: int, tokens: list[int]) -> None:
    placement = Placement.uniform(1, E, ranks, redundant)
    results, gate_up, down = ep_moe(placement, tokens)
    for x, ids, w, out in results:
        torch.testing.assert_close(out, dense(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


def test_an_idle_rank_serves_its_experts_with_no_tokens_of_its_own() -> None:
    placement = Placement.uniform(1, E, 2)
    results, gate_up, down = ep_moe(placement, [7, 0], active=[True, False])
    x, ids, w, out = results[0]
    torch.testing.assert_close(out, dense(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)
    assert results[1][3].shape == (0, D)


def test_fp8_dispatch_equals_the_dense_moe_on_fp8_rounded_inputs() -> None:
    placement = Placement.uniform(1, E, 2, num_redundant=2)
    results, gate_up, down = ep_moe(placement, [9, 4], fp8=True)
    for x, ids, w, out in results:
        xq = dequantize_fp8_groups(*quantize_for_dispatch(x), torch.float32)
        assert (xq - x).abs().max() > 0  # the wire format really is lossy
        torch.testing.assert_close(out, dense(xq, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


def test_fp8_needs_hidden_divisible_by_128() -> None:
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_for_dispatch(torch.ones(2, 100))


def test_unknown_and_missing_backends_say_what_is_wrong() -> None:
    comm = InProcessHub(1).comm(0)
    kw = dict(slots_per_rank=16, num_physical=16, hidden=D, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown EP dispatch backend 'nccl'"):
        make_dispatcher("nccl", comm, **kw)
    for backend, lib in (("deepep", "deep_ep"), ("mooncake", "mooncake.ep")):
        with pytest.raises(RuntimeError, match=lib):
            make_dispatcher(backend, comm, **kw)
