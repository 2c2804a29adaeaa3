"""Applying a new expert placement (libs/ep/rebalance.py): the plan every rank computes, FP8 expert weights
and their block scales moved in place (views and pointers kept) at world 1 and between rank processes over
gloo (and NCCL where two GPUs exist), the routing tables rewritten in place, and generation running across
a rebalance in an EP group with two-batch overlap giving the same greedy tokens as one engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.ep import eplb
from libs.ep.comm import Comm, InProcessHub, TorchComm
from libs.ep.engine import EPEngine
from libs.ep.placement import Placement
from libs.ep.rebalance import RoutingTables, apply_placement, plan_layer
from libs.quant.fp8 import FP8_DTYPE

E, LAYERS, D, I2 = 8, 2, 256, 256  # logical experts, MoE layers, hidden, 2 x expert width


def _placements(ranks: int, redundant: int) -> tuple[Placement, Placement]:
    old = Placement.uniform(LAYERS, E, ranks, redundant)
    load = torch.tensor([[5.0**i % 97 + 1 for i in range(E)], [float(E - i) ** 3 for i in range(E)]])
    new = eplb.rebalance(load, old.num_physical, ranks, num_groups=1)
    assert new != old
    return old, new


def test_every_new_slot_is_filled_once_and_sends_match_receives() -> None:
    old, new = _placements(4, 4)
    for j in range(LAYERS):
        olds = [old.local_experts(r)[j].tolist() for r in range(4)]
        news = [new.local_experts(r)[j].tolist() for r in range(4)]
        plans = [plan_layer(olds, news, r) for r in range(4)]
        for r, p in enumerate(plans):
            filled = sorted([s for s, _ in p.keeps] + [s for _, s in p.recvs])
            assert filled == list(range(len(news[r])))
            assert all(olds[r][o] == news[r][s] for s, o in p.keeps)
            for src, count in enumerate(p.recv_rows()):
                assert plans[src].send_rows()[r] == count
    with pytest.raises(ValueError, match="held by no rank"):
        plan_layer([[0, 1]], [[0, 2]], 0)


def _full_experts(seed: int) -> list[list[torch.Tensor]]:
    """Per layer, every logical expert's FP8 gate_up [E, 2I, D], down [E, D, I] and their block scales."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        w13 = torch.randn(E, I2, D, generator=g).to(FP8_DTYPE)
        w2 = torch.randn(E, D, I2 // 2, generator=g).to(FP8_DTYPE)
        s13 = torch.rand(E, I2 // 128, D // 128, generator=g)
        s2 = torch.rand(E, D // 128, I2 // 256, generator=g)
        out.append([w13, w2, s13, s2])
    return out


def _check_move(comm: Comm, device: torch.device, old: Placement, new: Placement) -> None:
    """This rank's stacks as `old` places them (each inside a larger tensor, as the fast path stacks the
    shared expert after the routed ones), moved to `new`: bit-exact, same storage, tables rewritten."""
    full = _full_experts(seed=7)
    me = comm.rank
    holders, stacks = [], []
    for j in range(LAYERS):
        local = old.local_experts(me)[j]
        layer = []
        for t in full[j]:
            outer = torch.zeros(local.numel() + 1, *t.shape[1:], dtype=t.dtype, device=device)
            outer.view(torch.uint8)[: local.numel()] = t[local].view(torch.uint8).to(device)
            holders.append(outer)
            layer.append(outer[: local.numel()])  # a view, like Experts.gate_up_proj on the fast path
        stacks.append(layer)
    ptrs = [t.data_ptr() for layer in stacks for t in layer]
    tables = RoutingTables(old, device)
    table_ptrs = (tables.log2phy.data_ptr(), tables.logcnt.data_ptr())
    apply_placement(comm, old, new, stacks, tables)
    assert [t.data_ptr() for layer in stacks for t in layer] == ptrs
    for j in range(LAYERS):
        local = new.local_experts(me)[j]
        for t, ref in zip(stacks[j], full[j], strict=True):
            assert torch.equal(t.cpu().view(torch.uint8), ref[local].view(torch.uint8))
    assert all(not h[-1].view(torch.uint8).any() for h in holders)  # the row past the stack is untouched
    assert (tables.log2phy.data_ptr(), tables.logcnt.data_ptr()) == table_ptrs
    ids = torch.arange(E, device=device).repeat(3, 1)  # [3, E]: every logical expert, three tokens
    for j in range(LAYERS):
        slots = new.to_physical(j, ids, me, tables.as_tuple())
        assert torch.equal(new.phy2log[j][slots.cpu()], ids.cpu())


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA")])],
)  # fmt: skip
def test_world_one_moves_fp8_weights_and_scales_in_place(device: str) -> None:
    old, new = _placements(1, 2)
    _check_move(InProcessHub(1).comm(0), torch.device(device), old, new)


def _rank_main(rank: int, backend: str, init: str, ranks: int) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=ranks)
    try:
        old, new = _placements(ranks, 2)
        _check_move(TorchComm(None, device), device, old, new)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
            ],
        ),
    ],
)
def test_two_ranks_move_fp8_weights_and_scales_device_to_device(tmp_path: Path, backend: str) -> None:
    """A failed check inside a rank process fails the spawn, naming it."""
    mp.spawn(_rank_main, args=(backend, f"file://{tmp_path}/store", 2), nprocs=2, join=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("rebalance") / "tiny", seed=0)


def test_generation_across_a_rebalance_with_tbo_keeps_every_request_exact(tiny: Path) -> None:
    """Two gloo rank processes, two-batch overlap on, redundant experts: EPLB's new placement is applied
    between two steps while every request is mid-generation; the greedy tokens are one engine's."""
    prompts = [[(o + 7 * i) % 1000 + 3 for i in range(n)] for o, n in ((1, 12), (2, 30), (3, 5), (4, 19))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = Engine.from_pretrained(tiny, num_pages=48, max_prefill_tokens=32)
    want = {f"r{i}": o.token_ids for i, o in enumerate(ref.generate(prompts, params))}
    with EPEngine(str(tiny), ep_size=2, num_pages=48, max_prefill_tokens=32, ep_redundant_experts=2,
                  two_batch_overlap=True) as ep:  # fmt: skip
        for rid, p in zip(want, prompts, strict=True):
            ep.add_request(rid, p, params)
        got: dict[str, list[int]] = {rid: [] for rid in want}
        for _ in range(3):
            for o in ep.step():
                got[o.rid] += o.token_ids
        before = ep.placement
        assert ep.rebalance() != before and ep.num_rebalances == 1
        assert all(0 < len(t) < 8 for t in got.values())  # every request is mid-generation
        while ep.has_unfinished():
            for o in ep.step():
                got[o.rid] += o.token_ids
        assert got == want
