"""The fixed-capacity dispatcher over the in-process hub (threads as ranks): rounds equal to the dense MoE and
to the all-to-all dispatcher, padding rows masked by the exchanged counts, the once-per-forward header, the
fallback for forwards above max_tokens, the clear errors (too many tokens, capacity overflow)."""

from __future__ import annotations

import pytest
import torch

from libs.ep.comm import InProcessHub
from libs.ep.dispatch.base import quantize_for_dispatch
from libs.ep.dispatch.factory import make_dispatcher, resolve_backend
from libs.ep.dispatch.fixed import FixedDispatcher
from libs.ep.experts import run_local_experts
from libs.ep.placement import Placement
from libs.quant.fp8 import dequantize_fp8_groups
from tests.libs.ep.inprocess import run_ranks
from tests.libs.ep.test_dispatch import D, E, K, dense, experts_weights, routing


def fixed(comm, placement: Placement, max_tokens: int, **kw) -> FixedDispatcher:
    d = make_dispatcher(
        "fixed", comm, slots_per_rank=placement.slots_per_rank, num_physical=placement.num_physical, hidden=D,
        dtype=torch.float32, top_k=K, max_tokens=max_tokens, **kw,
    )  # fmt: skip
    assert isinstance(d, FixedDispatcher)
    return d


def rounds(placement: Placement, tokens: list[int], max_tokens: int, rounds_per_forward: int = 1, **kw):
    """Every rank: `rounds_per_forward` rounds of dispatch -> local experts -> combine, then the idle round
    that ends the operation; -> per rank (x, ids, w, outputs) with each round's output."""
    gate_up, down = experts_weights()
    hub = InProcessHub(placement.ep_size)

    def rank(r: int):
        disp = fixed(hub.comm(r), placement, max_tokens, **kw)
        disp.set_rounds_per_forward(rounds_per_forward)
        local = placement.local_experts(r)[0]
        x, ids, w = routing(tokens[r], seed=r)
        slots = placement.to_physical(0, ids, r)
        outs = []
        for _ in range(rounds_per_forward):
            d = disp.dispatch(x, slots, w, active=True)
            assert d is not None
            outs.append(disp.combine(run_local_experts(gate_up[local], down[local], d), d))
        assert disp.dispatch(x[:0], slots[:0], w[:0], active=False) is None
        disp.check()
        return x, ids, w, outs

    return run_ranks(placement.ep_size, rank), gate_up, down


@pytest.mark.parametrize(
    ("ranks", "redundant", "tokens"), [(2, 0, [5, 9]), (4, 4, [8, 2, 5, 9])], ids=["2-ranks", "4-ranks-redundant"]
)
def test_fixed_rounds_equal_the_dense_moe(ranks: int, redundant: int, tokens: list[int]) -> None:
    placement = Placement.uniform(1, E, ranks, redundant)
    results, gate_up, down = rounds(placement, tokens, max_tokens=12, rounds_per_forward=3)
    for x, ids, w, outs in results:
        for out in outs:  # three rounds of one forward, the header exchanged once
            torch.testing.assert_close(out, dense(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


def test_fp8_wire_rows_round_trip_and_equal_the_dense_moe_on_their_rounded_inputs() -> None:
    placement = Placement.uniform(1, E, 2, num_redundant=2)
    results, gate_up, down = rounds(placement, [9, 4], max_tokens=9, fp8=True)
    for x, ids, w, (out,) in results:
        xq = dequantize_fp8_groups(*quantize_for_dispatch(x), torch.float32)
        torch.testing.assert_close(out, dense(xq, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


def test_received_rows_carry_each_token_once_per_rank_with_its_local_ids() -> None:
    """Rank 0 sends 3 tokens to 2 ranks (8 slots each): rows land in the sender's block of each receiver,
    padding rows past the exchanged count get no experts whatever the buffer holds."""
    placement = Placement.uniform(1, E, 2)
    hub = InProcessHub(2)
    x = torch.arange(3 * D, dtype=torch.float32).view(3, D)
    slots = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11], [1, 9, 2, 10]])
    w = torch.full((3, K), 0.25)

    def rank(r: int):
        disp = fixed(hub.comm(r), placement, max_tokens=4)
        if r == 0:
            return disp.exchange(x, slots, w)
        return disp.exchange(x[:0], slots[:0], w[:0])

    got0, got1 = run_ranks(2, rank)
    assert got0.x.shape == (8, D)  # N x C rows, C = max_tokens
    # rank 0 holds slots 0-7: tokens 0 and 2 from rank 0 (rows 0, 1), nothing from rank 1 (rows 4-7)
    torch.testing.assert_close(got0.x[:2], x[[0, 2]])
    assert got0.local_ids.tolist()[:2] == [[0, 1, 2, 3], [1, -1, 2, -1]]
    assert (got0.local_ids[2:] == -1).all() and (got0.weights[2:] == 0).all()
    torch.testing.assert_close(got1.x[:2], x[[1, 2]])
    assert got1.local_ids.tolist()[:2] == [[0, 1, 2, 3], [-1, 1, -1, 2]]
    assert (got1.local_ids[2:] == -1).all()


def test_a_forward_above_max_tokens_takes_the_all_to_all_fallback_on_every_rank() -> None:
    placement = Placement.uniform(1, E, 2)
    results, gate_up, down = rounds(placement, [3, 20], max_tokens=8, rounds_per_forward=2)
    for x, ids, w, outs in results:
        for out in outs:
            torch.testing.assert_close(out, dense(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sizes", [[(2, 3), (3, 7)], [(6, 1), (0, 2)]], ids=["b-over-on-1", "a-over-on-0"])
def test_two_batch_overlap_sends_only_the_micro_batch_that_does_not_fit_through_the_fallback(
    sizes: list[tuple[int, int]],
) -> None:
    """Rounds alternate micro-batch A, B over 2 MoE layers (rounds_per_layer 2), max_tokens 4: the header goes at
    each micro-batch's first round, and only the micro-batch that some rank cannot fit takes the fallback, for
    all its rounds; every round equals the dense MoE. Uneven splits of an extend batch make such forwards."""
    placement = Placement.uniform(1, E, 2)
    gate_up, down = experts_weights()
    hub = InProcessHub(2)
    over = [max(rank[part] for rank in sizes) > 4 for part in (0, 1)]

    def rank(r: int):
        disp = fixed(hub.comm(r), placement, max_tokens=4)
        disp.set_rounds_per_forward(4, rounds_per_layer=2)
        local = placement.local_experts(r)[0]
        parts = [routing(n, seed=10 * r + i) for i, n in enumerate(sizes[r])]
        outs = []
        for _layer in range(2):
            for x, ids, w in parts:
                d = disp.dispatch(x, placement.to_physical(0, ids, r), w, active=True)
                assert d is not None
                out = disp.combine(run_local_experts(gate_up[local], down[local], d), d)
                outs.append((d.handle[0], out, dense(x, ids, w, gate_up, down)))
        x0, ids0, w0 = parts[0]
        assert disp.dispatch(x0[:0], ids0[:0], w0[:0], active=False) is None
        disp.check()
        return outs

    for outs in run_ranks(2, rank):
        assert [kind for kind, _, _ in outs] == ["fallback" if over[i % 2] else "fixed" for i in range(4)]
        for _, out, want in outs:
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_too_many_tokens_for_a_header_free_round_is_a_clear_error() -> None:
    placement = Placement.uniform(1, E, 1)
    disp = fixed(InProcessHub(1).comm(0), placement, max_tokens=4)
    x, ids, w = routing(5, seed=0)
    with pytest.raises(ValueError, match="5 tokens exceed the EP dispatcher's max_tokens 4"):
        disp.exchange(x, ids, w)


def test_capacity_overflow_is_flagged_on_the_device_and_raised_by_check() -> None:
    """capacity_factor shrinks the per-peer rows below max_tokens: a round that needs more raises at check(),
    and one that fits does not."""
    placement = Placement.uniform(1, E, 2)
    hub = InProcessHub(2)

    def rank(r: int, t: int):
        disp = fixed(hub.comm(r), placement, max_tokens=8, capacity_factor=0.25)  # C = 8 * 2 * 0.25 / 2 = 2
        assert disp.capacity == 2
        ids = torch.tensor([[0, 1, 2, 3]] * t)  # every token to rank 0
        x, w = torch.randn(t, D), torch.ones(t, K)
        disp.exchange(x, ids, w)
        try:
            disp.check()
        except RuntimeError as e:
            return str(e)
        return None

    assert run_ranks(2, lambda r: rank(r, 2)) == [None, None]
    errors = run_ranks(2, lambda r: rank(r, 3 if r == 1 else 1))
    assert errors[0] is None and "more than 2 rows for one peer" in errors[1]


def test_auto_backend_is_fixed_on_cuda_and_all_to_all_elsewhere() -> None:
    assert resolve_backend("auto", "cuda") == "fixed"
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("deepep", "cuda") == "deepep"
    with pytest.raises(ValueError, match="needs top_k and max_tokens"):
        make_dispatcher("fixed", InProcessHub(1).comm(0), slots_per_rank=E, num_physical=E, hidden=D,
                        dtype=torch.float32)  # fmt: skip


def test_an_idle_rank_with_fp8_rows_serves_its_experts() -> None:
    placement = Placement.uniform(1, E, 2)
    gate_up, down = experts_weights()
    hub = InProcessHub(2)

    def rank(r: int):
        disp = fixed(hub.comm(r), placement, max_tokens=8, fp8=True)
        x, ids, w = routing(7 if r == 0 else 0, seed=r)
        slots = placement.to_physical(0, ids, r)
        local = placement.local_experts(r)[0]
        d = disp.dispatch(x, slots, w, active=r == 0)
        assert d is not None
        return x, ids, w, disp.combine(run_local_experts(gate_up[local], down[local], d), d)

    (x, ids, w, out), (_, _, _, idle_out) = run_ranks(2, rank)
    xq = dequantize_fp8_groups(*quantize_for_dispatch(x), torch.float32)
    torch.testing.assert_close(out, dense(xq, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)
    assert idle_out.shape == (0, D)
