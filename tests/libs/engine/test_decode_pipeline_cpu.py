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

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 7], list(range(40, 61)), [9] * 30, [1, 2, 3]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("ovl") / "m", seed=5), progress=False)


def _engine(model, overlap: bool) -> Engine:
    e = Engine(model, page_size=16, num_pages=128, max_num_seqs=8, overlap=False)
    if overlap:
        e._overlap = OverlapDecoder(e, eager=True)
    return e


def _count_drains(engine: Engine) -> list[int]:
    """The outputs of each drain of the overlapped path, as they happen (a drain that read tokens left it)."""
    drained: list[int] = []
    if engine._overlap is not None:
        drain = engine._overlap.drain

        def counted() -> list:
            out = drain()
            drained.append(len(out))
            return out

        engine._overlap.drain = counted  # type: ignore[method-assign]
    return drained


def _join(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> int:
    """A PD join: prefilled on one engine, its KV copied into the other's reserved pages, add_prefilled."""
    res = prefill.prefill(rid, prompt, params)
    pages = decode.reserve(rid, len(prompt))
    pool_p, pool_d = prefill.kv_pool, decode.kv_pool
    src = pool_p.buffer.view(pool_p.num_layers, -1, pool_p.page_size, pool_p.buffer.shape[-1])
    dst = pool_d.buffer.view(pool_d.num_layers, -1, pool_d.page_size, pool_d.buffer.shape[-1])
    dst[:, pages] = src[:, res.page_ids]
    prefill.release(rid)
    decode.add_prefilled(rid, prompt, res.first_token, params)
    return res.first_token


def _no_leak(engine: Engine) -> None:
    st = engine.stats()
    assert st["used_pages"] == st["cached_pages"] and st["running"] == 0 and not engine.has_unfinished()


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
        _no_leak(engine)
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
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    runs = []
    for overlap in (False, True):
        prefill, decode = _engine(model, False), _engine(model, overlap)
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
        _no_leak(decode)
        runs.append((got, drained))
    (plain, _), (fast, drained) = runs
    assert fast == plain
    assert sum(1 for n in drained if n) == 1, drained  # only after the last request's last token


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the graph path (test_decode_pipeline.py)")
def test_a_pool_full_of_cache_evicts_without_leaving_the_overlap(model):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        engine = _engine(model, overlap)
        i = 0
        while engine.stats()["free_pages"] >= 6:  # finished prompts stay cached (evictable)
            prompt = [(7 * i + k) % 500 + 3 for k in range(100)]
            engine.add_request(
                f"fill{i}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            )
            while engine.has_unfinished():
                engine.step()
            i += 1
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
        _no_leak(engine)
        runs.append((got, drained))
    (plain, _), (fast, drained) = runs
    assert fast == plain
    assert sum(1 for n in drained if n) == 1, drained  # where the four end together
