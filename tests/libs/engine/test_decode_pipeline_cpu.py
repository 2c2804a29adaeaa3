"""Overlapped decode's host logic on the CPU (OverlapDecoder(eager=True): the same batch-change, page and
read-back logic over eager forwards instead of the captured graph), so CI covers what otherwise only runs
on a GPU (test_decode_pipeline.py): the plain step's greedy tokens with requests finishing at different
lengths, joining through the PD path and through the queue, aborted mid-flight; no drain for finishes, PD
joins or a pool that must evict its prefix cache; no page left behind."""

from __future__ import annotations

# first, before anything imports triton: the one-pass sampling kernel runs under the interpreter here
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import pytest

from libs.engine.decode_pipeline import OverlapDecoder
from libs.engine.engine import Engine
from libs.engine.loader import load_model
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import write_tiny_model
from tests.libs.engine.overlap_scenarios import (
    PROMPTS,
    a_pool_full_of_cache_evicts_without_leaving_the_overlap,
    assert_no_leak,
    finishes_and_pd_joins_stay_in_the_overlap,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("ovl") / "m", seed=5), progress=False)


def _engine(model, overlap: bool) -> Engine:
    e = Engine(model, page_size=16, num_pages=128, max_num_seqs=8, overlap=False)
    if overlap:
        e._overlap = OverlapDecoder(e, eager=True)
    return e


GREEDY = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the graph path (test_decode_pipeline.py)")
@pytest.mark.parametrize("abort_after", [None, 6])
def test_overlap_gives_the_plain_steps_tokens(model, abort_after):
    """Direct requests: finishes at 4, 7, 10, 13 tokens, one joining through the queue at step 4 (a
    prefill: drains), r0 aborted while a step is in flight when abort_after is set."""
    runs = []
    for overlap in (False, True):
        engine = _engine(model, overlap)
        got: dict[str, list[int]] = {}
        for i in range(4):
            engine.add_request(f"r{i}", PROMPTS[i], GREEDY[i])
        steps = overlapped = 0
        while engine.has_unfinished():
            overlapped += engine._overlap is not None and engine._overlap.inflight is not None
            for out in engine.step():
                got.setdefault(out.rid, []).extend(out.token_ids)
            steps += 1
            if steps == 4:
                engine.add_request("late", PROMPTS[4], GREEDY[4])
            if abort_after is not None and steps == abort_after:
                engine.abort("r0")
        assert_no_leak(engine)
        runs.append((got, overlapped))
    (plain, _), (fast, overlapped) = runs
    assert overlapped > 5, "the overlapped path ran"
    if abort_after is None:
        assert fast == plain
        assert [len(fast[f"r{i}"]) for i in range(4)] == [4, 7, 10, 13]
    else:  # r0 cut short (its in-flight token dropped), every other request as without the abort
        assert len(fast["r0"]) < 4 or fast["r0"] == plain["r0"]
        assert {k: v for k, v in fast.items() if k != "r0"} == {k: v for k, v in plain.items() if k != "r0"}


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the graph path (test_decode_pipeline.py)")
def test_finishes_and_pd_joins_stay_in_the_overlap(model):
    finishes_and_pd_joins_stay_in_the_overlap(lambda overlap: _engine(model, overlap), temperature=0.0)


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the graph path (test_decode_pipeline.py)")
def test_a_pool_full_of_cache_evicts_without_leaving_the_overlap(model):
    a_pool_full_of_cache_evicts_without_leaving_the_overlap(lambda overlap: _engine(model, overlap))


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the graph path (test_decode_pipeline.py)")
def test_warm_up_runs_the_gather_of_a_changing_batch(model, monkeypatch):
    """A worker's warm-up ends each decode batch in two lengths, so the overlapped decode's device gather
    of the carried rows' tokens (its own kernels, first used at a served batch's first finish: a 285 ms
    step on the H200 before) runs before serving; the pool is as it was."""
    import libs.engine.decode_pipeline as dp
    from libs.worker.warmup import plan_warmup, run_warmup

    gathers: list[list[int]] = []
    real = dp._inputs

    def spy(prev, src, tokens):
        if prev is not None and any(i >= 0 for i in src) and src != list(range(len(prev.reqs))):
            gathers.append(list(src))
        return real(prev, src, tokens)

    monkeypatch.setattr(dp, "_inputs", spy)
    engine = _engine(model, True)
    before = engine.stats()
    plan = plan_warmup(4, 8, page_size=16, free_pages=before["free_pages"], context_len=64, decode=True)
    run_warmup(engine, plan)
    assert engine.stats() == before
    assert [len(g) for g in gathers] == [1, 2, 4]  # batches 2, 4, 8: their longer half carried on
