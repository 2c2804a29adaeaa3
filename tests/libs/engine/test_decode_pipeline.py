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
from tests.libs.engine.test_fast_path import FAST, _damp

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="overlapped decode runs on captured CUDA graphs")
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 7], list(range(40, 61)), [9] * 30, [1, 2, 3]]


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


def _fill_cache(engine: Engine, keep_free: int) -> None:
    """Finished prompts' pages stay in the prefix cache (evictable) until fewer than keep_free pages are free."""
    i = 0
    while engine.stats()["free_pages"] >= keep_free:
        prompt = [(7 * i + k) % 500 + 3 for k in range(100)]  # each its own first token: no shared prefix
        engine.add_request(f"fill{i}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        i += 1


def _count_drains(engine: Engine) -> list[int]:
    """The outputs of each drain of the overlapped path, as they happen."""
    drained: list[int] = []
    if engine._overlap is not None:
        drain = engine._overlap.drain

        def counted() -> list:
            out = drain()
            drained.append(len(out))
            return out

        engine._overlap.drain = counted  # type: ignore[method-assign]
    return drained


def test_a_pool_full_of_cache_evicts_without_leaving_the_overlap(ckpt):
    """A decode worker's pool fills with cached prompts; a steady batch that needs a page then evicts
    from the cache inside the overlapped step. It used to count only free pages, drain and run the plain
    step (3x a step's time on the H200) each time the cache gave way: ~1 step in 7 of the served batch."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        engine = _engine(ckpt, overlap=overlap)
        _fill_cache(engine, keep_free=6)
        cached = engine.stats()["cached_pages"]
        drained = _count_drains(engine)
        for j, p in enumerate(PROMPTS[:4]):
            engine.add_request(f"r{j}", p, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.rid, []).extend(out.token_ids)
        assert [len(got[f"r{j}"]) for j in range(4)] == [40] * 4
        assert engine.stats()["cached_pages"] < cached, "the batch's pages came from the cache"
        runs.append((got, drained))
    (plain, _), (fast, drained) = runs
    assert fast == plain
    # one drain that read an in-flight step: where the four requests end together (max_tokens)
    assert sum(1 for n in drained if n) == 1, drained


def _join(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> int:
    """A PD join: the prompt prefilled on one engine, its KV copied into the other's reserved pages (what
    the KV transfer writes), then add_prefilled. Returns the first token."""
    res = prefill.prefill(rid, prompt, params)
    pages = decode.reserve(rid, len(prompt))
    pool_p, pool_d = prefill.kv_pool, decode.kv_pool
    src = pool_p.buffer.view(pool_p.num_layers, -1, pool_p.page_size, pool_p.buffer.shape[-1])
    dst = pool_d.buffer.view(pool_d.num_layers, -1, pool_d.page_size, pool_d.buffer.shape[-1])
    dst[:, pages] = src[:, res.page_ids]
    prefill.release(rid)
    decode.add_prefilled(rid, prompt, res.first_token, params)
    return res.first_token


def test_finishes_and_pd_joins_stay_in_the_overlap(ckpt):
    """A served decode batch changes every few steps: requests end (max_tokens, known ahead) and others join
    with their KV in place. Both used to drain the in-flight step and run the plain step (20-54 ms against
    5.7 at B=256 on the H200); now the rows that carry on take their tokens from the in-flight step by a
    gather on the device and the joined ones from the host, with the plain step's tokens."""
    params = [SamplingParams(temperature=0.8 * (i == 1), seed=i, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    runs = []
    for overlap in (False, True):
        prefill, decode = _engine(ckpt, overlap=False), _engine(ckpt, overlap=overlap)
        drained = _count_drains(decode)
        got = {f"r{i}": [_join(prefill, decode, f"r{i}", PROMPTS[i], params[i])] for i in range(3)}
        steps = 0
        while decode.has_unfinished():
            for out in decode.step():
                got[out.rid].extend(out.token_ids)
            steps += 1
            if steps == 3:  # two join while the first three run
                for i in (3, 4):
                    got[f"r{i}"] = [_join(prefill, decode, f"r{i}", PROMPTS[i], params[i])]
        assert [len(got[f"r{i}"]) for i in range(5)] == [6, 9, 12, 15, 18]
        st = decode.stats()
        assert st["used_pages"] == st["cached_pages"] and st["running"] == 0
        runs.append((got, drained))
    (plain, _), (fast, drained) = runs
    assert fast == plain
    # the only drain that read an in-flight step: after the last request's last token
    assert sum(1 for n in drained if n) == 1, drained
