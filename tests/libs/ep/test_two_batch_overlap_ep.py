"""Two-batch overlap in EP groups against the single-rank engine on the same tiny checkpoint: ranks as
threads (the in-process hub), then rank processes over gloo, where dispatch and combine are asynchronous
all-to-alls (torch.distributed async work) finished while the other micro-batch computes."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from libs.engine import Engine, SamplingParams, load_model
from libs.engine.tiny import write_tiny_model
from libs.engine.two_batch_overlap import enable
from libs.ep.comm import TorchComm
from libs.ep.engine import EPEngine
from libs.ep.placement import Placement
from tests.libs.ep.inprocess import inprocess_group, run_ranks

E = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[(o + 7 * i) % 1000 + 3 for i in range(n)] for o, n in ((1, 1), (2, 45), (3, 9), (4, 20), (5, 3))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tbo-ep") / "tiny", seed=0)


@pytest.fixture(scope="module")
def want(tiny: Path) -> list[list[int]]:
    ref = Engine.from_pretrained(tiny, num_pages=48, max_prefill_tokens=32)
    return [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def test_ranks_with_tbo_running_uneven_work_equal_the_single_rank_engine(tiny: Path, want) -> None:
    """Rank 0 splits its batches, rank 1 has one prompt (its second micro-batch is empty), rank 2 idles:
    every MoE layer is still two rounds on every rank, served with the right layer's experts."""
    model = load_model(tiny, progress=False)
    workers = inprocess_group(copy.deepcopy(model), Placement.uniform(2, E, 3, 2), num_pages=48,
                              max_prefill_tokens=32)  # fmt: skip
    for w in workers:
        enable(w.engine.model, w.engine.runner.backend)
        assert w.engine.model.tbo.paired and w.runtime.rounds_per_layer == 2
    mine = {0: [0, 1, 2, 3], 1: [4], 2: []}

    def run(r: int):
        if not mine[r]:
            return workers[r].run_op("idle", ())
        return workers[r].run_op("generate", ([PROMPTS[i] for i in mine[r]], GREEDY))

    results = run_ranks(3, run)
    got = dict(zip(mine[0] + mine[1], [o.token_ids for o in results[0] + results[1]], strict=True))
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert workers[0].engine.model.tbo.split_forwards > 0
    assert all(w.runtime.rounds == 0 for w in workers)


def test_gloo_group_with_tbo_equals_the_single_rank_engine(tiny: Path, want) -> None:
    with EPEngine(str(tiny), ep_size=2, num_pages=48, max_prefill_tokens=32, two_batch_overlap=True) as ep:
        assert [o.token_ids for o in ep.generate(PROMPTS, GREEDY)] == want
        ref = Engine.from_pretrained(tiny, num_pages=48, max_prefill_tokens=32)
        for p, got in zip(PROMPTS[1:3], ep.prefill_logits_many(PROMPTS[1:3]), strict=True):
            torch.testing.assert_close(got, ref.prefill_logits(p), atol=1e-5, rtol=1e-5)


def test_gloo_group_with_tbo_on_the_fixed_dispatcher_equals_the_single_rank_engine(tiny: Path, want) -> None:
    """The fixed-capacity dispatcher under TBO, sized for one micro-batch a round (max_tokens half of
    max_num_seqs, 4 here, so prompts' micro-batches exceed it and decode's fit): greedy tokens equal one
    engine's. Which path each micro-batch's rounds take is asserted in test_fixed_dispatch.py."""
    with EPEngine(str(tiny), ep_size=2, num_pages=48, max_prefill_tokens=32, max_num_seqs=8, ep_backend="fixed",
                  two_batch_overlap=True) as ep:  # fmt: skip
        assert [o.token_ids for o in ep.generate(PROMPTS, GREEDY)] == want


def _started_rank(rank: int, init: str) -> None:
    """Rank 0 starts an all-to-all, then sends rank 1 the message rank 1 waits for before joining it: only
    a start that returns before the peers have joined gets through (else both wait until the timeout)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        side = dist.new_group(backend="gloo")
        comm = TorchComm()
        rows = torch.full((2, 3), float(rank))
        flag = torch.zeros(1)
        if rank == 0:
            pending = comm.all_to_all_start(rows, [1, 1], [1, 1])
            dist.send(torch.ones(1), dst=1, group=side)
            got = pending.wait()
        else:
            dist.recv(flag, src=0, group=side)
            got = comm.all_to_all(rows, [1, 1], [1, 1])
        assert got[:, 0].tolist() == [0.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_a_started_all_to_all_returns_before_the_peers_join(tmp_path: Path) -> None:
    """What the overlap rests on over torch.distributed: dispatch/combine start without waiting."""
    mp.spawn(_started_rank, args=(f"file://{tmp_path}/store",), nprocs=2, join=True)


def test_a_tbo_rank_whose_experts_fail_finishes_its_rounds_then_reports(tiny: Path) -> None:
    """The failing rank's other micro-batch has rounds in flight: it finishes the forward (nobody hangs) and
    raises once the operation's rounds are over; the healthy rank completes."""
    model = load_model(tiny, progress=False)
    workers = inprocess_group(
        copy.deepcopy(model), Placement.uniform(2, E, 2), num_pages=48, max_prefill_tokens=32
    )
    for w in workers:
        enable(w.engine.model, w.engine.runner.backend)
    broken = workers[1].runtime.experts[0]
    broken.down_proj = torch.nn.Parameter(broken.down_proj.data[:, :, :1].clone(), requires_grad=False)
    mine = {0: PROMPTS[1:3], 1: PROMPTS[3:5]}

    def run(r: int):
        try:
            return workers[r].run_op("generate", (mine[r], GREEDY))
        except RuntimeError as e:
            return e

    ok, err = run_ranks(2, run)
    assert isinstance(err, RuntimeError) and [len(o.token_ids) for o in ok] == [6, 6]
    assert all(w.runtime.rounds == 0 and w.runtime.deferred_failure is None for w in workers)
