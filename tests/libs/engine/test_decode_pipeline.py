"""Overlapped decode (libs/engine/decode_pipeline.py) on a GPU: the same tokens as the plain step, greedy and seeded
sampling, with requests of different lengths finishing, joining and being aborted mid-stream, and no page
left behind."""

from __future__ import annotations

# first, before anything imports triton: selects and patches the interpreter when there is no GPU
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import pytest

from libs.engine.engine import Engine
from libs.engine.loader import load_model
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import write_tiny_model
from tests.libs.engine.overlap_scenarios import (
    PROMPTS,
    a_pool_full_of_cache_evicts_without_leaving_the_overlap,
    finishes_and_pd_joins_stay_in_the_overlap,
)
from tests.libs.engine.test_fast_path import FAST, _damp

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="overlapped decode runs on captured CUDA graphs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("overlap") / "m", seed=5, fp8=True, **FAST)


def _engine(ckpt, overlap: bool) -> Engine:
    """Damped (test_fast_path._damp): the FP8 GEMMs' split-K sums with atomics, so two engines of a random
    model can part at a near-tie (seen on the H200: the first token already differed, overlap or not);
    with margins, equal tokens test the overlap itself."""
    model = load_model(ckpt, dtype="bfloat16", device="cuda", progress=False, quantization="fp8")
    _damp(model)
    return Engine(model, page_size=16, num_pages=128, max_num_seqs=8, overlap=overlap)


def _run(
    engine: Engine, params: list[SamplingParams], abort_after: int | None = None
) -> dict[str, list[int]]:
    """Every prompt as its own request; the last one joins after a few steps (a composition change)."""
    got: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(PROMPTS[:-1], params, strict=False)):
        engine.add_request(f"r{i}", p, sp)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.rid, []).extend(out.token_ids)
        steps += 1
        if steps == 4:
            engine.add_request("late", PROMPTS[-1], params[-1])
        if abort_after is not None and steps == abort_after:
            engine.abort("r0")
    return got


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlap_gives_the_plain_steps_tokens(ckpt, temperature):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    plain_engine, fast_engine = _engine(ckpt, overlap=False), _engine(ckpt, overlap=True)
    assert plain_engine._overlap is None and fast_engine._overlap is not None
    plain, overlapped = _run(plain_engine, params), _run(fast_engine, params)
    assert overlapped == plain
    assert [len(overlapped[f"r{i}"]) for i in range(4)] == [4, 7, 10, 13]
    for e in (plain_engine, fast_engine):
        st = e.stats()
        assert st["used_pages"] == st["cached_pages"] and st["running"] == 0


def test_abort_while_a_step_is_in_flight_drops_its_token_and_pages(ckpt):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    engine = _engine(ckpt, overlap=True)
    got = _run(engine, params, abort_after=6)
    assert len(got["r0"]) < 12 and all(len(got[f"r{i}"]) == 12 for i in range(1, 4))
    st = engine.stats()
    assert st["used_pages"] == st["cached_pages"] and st["running"] == 0


def test_chosen_token_logprobs_ride_the_overlapped_steps(ckpt):
    """Logprobs of the chosen token come from the one-pass kernel, so such requests overlap too, with the
    plain step's tokens and logprobs (within the kernel's fp32 log-sum-exp)."""
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=10, ignore_eos=True, logprobs=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    plain_engine, fast_engine = _engine(ckpt, overlap=False), _engine(ckpt, overlap=True)
    runs = []
    for engine in (plain_engine, fast_engine):
        lps: dict[str, list[float]] = {}
        for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        overlapped = 0
        while engine.has_unfinished():
            overlapped += engine._overlap is not None and engine._overlap.inflight is not None
            for out in engine.step():
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
                lps.setdefault(out.rid, []).extend(lp.logprob for lp in out.logprobs)
        runs.append((lps, overlapped))
    (plain, _), (fast, overlapped) = runs
    assert overlapped > 0, "the logprob requests took the overlapped path"
    assert plain.keys() == fast.keys()
    for rid in plain:
        assert len(plain[rid]) == len(fast[rid]) == 10
        assert max(abs(a - b) for a, b in zip(plain[rid], fast[rid], strict=True)) < 0.05


def test_a_pool_full_of_cache_evicts_without_leaving_the_overlap(ckpt):
    a_pool_full_of_cache_evicts_without_leaving_the_overlap(lambda overlap: _engine(ckpt, overlap))


def test_finishes_and_pd_joins_stay_in_the_overlap(ckpt):
    finishes_and_pd_joins_stay_in_the_overlap(lambda overlap: _engine(ckpt, overlap))
