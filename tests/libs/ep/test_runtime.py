"""EP ranks as threads (in-process hub): the lockstep protocol, placement swaps, expert load, against the
single-rank engine on the same tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine import Engine, load_model
from libs.engine.tiny import write_tiny_model
from libs.ep import eplb
from libs.ep.placement import Placement
from libs.ep.runtime import moe_layers
from tests.libs.ep.inprocess import inprocess_group, run_ranks

E = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path: Path = write_tiny_model(tmp_path_factory.mktemp("ep-rt") / "tiny", seed=1)
    return load_model(path, progress=False)


@pytest.fixture(scope="module")
def ref(model) -> Engine:
    return Engine(model, num_pages=64, max_prefill_tokens=16)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 11 * i) % 900 + 3 for i in range(n)]


def test_ranks_running_different_numbers_of_forwards_stay_in_lockstep(model, ref) -> None:
    workers = inprocess_group(model, Placement.uniform(2, E, 4), num_pages=64, max_prefill_tokens=16)
    prompts = [prompt(40, 1), prompt(5, 2), [], prompt(20, 3)]  # 3, 1, 0 and 2 chunked forwards

    def run(r: int):
        op = ("prefill_logits", (prompts[r],)) if prompts[r] else ("idle", ())
        return workers[r].run_op(*op)

    results = run_ranks(4, run)
    for p, got in zip(prompts, results, strict=True):
        if p:
            torch.testing.assert_close(torch.from_numpy(got), ref.prefill_logits(p), atol=1e-5, rtol=1e-5)
    assert all(w.runtime.rounds == 0 for w in workers)


def test_a_rank_whose_request_fails_still_serves_the_others(model, ref) -> None:
    workers = inprocess_group(model, Placement.uniform(2, E, 2), num_pages=64)
    prompts = [prompt(12, 4), [10**6]]  # rank 1's token is outside the vocabulary

    def run(r: int):
        try:
            return workers[r].run_op("prefill_logits", (prompts[r],))
        except ValueError as e:
            return e

    got, err = run_ranks(2, run)
    assert isinstance(err, ValueError) and "vocabulary" in str(err)
    torch.testing.assert_close(torch.from_numpy(got), ref.prefill_logits(prompts[0]), atol=1e-5, rtol=1e-5)


def test_a_rank_whose_experts_fail_mid_forward_still_completes_the_round(model) -> None:
    """The failing rank still joins the combine and every later round, so nobody hangs; it reports the error."""
    workers = inprocess_group(model, Placement.uniform(2, E, 2), num_pages=64)
    broken = workers[1].runtime.experts[0]
    broken.down_proj = torch.nn.Parameter(broken.down_proj.data[:, :, :1].clone(), requires_grad=False)
    prompts = [prompt(12, 7), prompt(9, 8)]

    def run(r: int):
        try:
            return workers[r].run_op("prefill_logits", (prompts[r],))
        except RuntimeError as e:
            return e

    ok, err = run_ranks(2, run)
    assert isinstance(err, RuntimeError) and not isinstance(ok, Exception)
    assert ok.shape == (12, model.config.vocab_size)  # finished (its layer-0 output lacks rank 1's experts)
    assert all(w.runtime.rounds == 0 for w in workers)


def test_a_placement_swap_moves_expert_weights_to_their_new_ranks(model) -> None:
    old = Placement.uniform(2, E, 2, num_redundant=2)
    workers = inprocess_group(model, old, num_pages=16)
    load = torch.tensor([[2.0**i for i in range(E)], [3.0 ** (i % 5) for i in range(E)]])
    new = eplb.rebalance(load, old.num_physical, 2, num_groups=4)
    assert new != old
    run_ranks(2, lambda r: workers[r].run_op("rebalance", (new.to_wire(),)))
    full = [moe.experts for _, moe in moe_layers(model)]
    for r, w in enumerate(workers):
        local = new.local_experts(r)
        for j, ex in enumerate(w.runtime.experts):
            assert torch.equal(ex.gate_up_proj, full[j].gate_up_proj[local[j]])
            assert torch.equal(ex.down_proj, full[j].down_proj[local[j]])
        assert w.runtime.placement == new


def test_expert_load_counts_every_routed_token_once(model) -> None:
    workers = inprocess_group(model, Placement.uniform(2, E, 2), num_pages=64)
    prompts = [prompt(9, 5), prompt(4, 6)]
    run_ranks(2, lambda r: workers[r].run_op("prefill_logits", (prompts[r],)))
    total = sum(w.runtime.take_load() for w in workers)
    k = model.config.num_experts_per_tok
    assert total.sum(axis=1).tolist() == [13 * k, 13 * k]
    assert workers[0].runtime.take_load().sum() == 0  # taking resets


def test_a_placement_swap_moves_fp8_experts_with_their_block_scales(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "fp8", seed=2, fp8=True, num_hidden_layers=2, moe_intermediate_size=128,
                            intermediate_size=128)  # fmt: skip
    fp8_model = load_model(path, progress=False, quantization="fp8")
    old = Placement.uniform(1, E, 2, num_redundant=2)
    workers = inprocess_group(fp8_model, old, num_pages=4)
    new = eplb.rebalance(torch.tensor([[2.0**i for i in range(E)]]), old.num_physical, 2, num_groups=4)
    assert new != old
    run_ranks(2, lambda r: workers[r].run_op("rebalance", (new.to_wire(),)))
    (_, full_moe), = moe_layers(fp8_model)
    full = full_moe.experts
    for r, w in enumerate(workers):
        local = new.local_experts(r)[0]
        ex = w.runtime.experts[0]
        assert ex.is_fp8 and ex.gate_up_proj.dtype == torch.float8_e4m3fn
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
            assert torch.equal(getattr(ex, name).view(torch.uint8), getattr(full, name)[local].view(torch.uint8))
