"""The engine against transformers' DeepseekV3ForCausalLM on a random tiny checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch

from libs.engine import Engine, GenerationOutput, SamplingParams
from tests.libs.engine.hf_utils import hf_model, make_hf_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], list(range(20, 45)), [7] * 12]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_v3"), seed=3)


@pytest.fixture(scope="module")
def hf(ckpt):
    model = hf_model(ckpt)
    model.generation_config.eos_token_id = None
    return model


def make_engine(ckpt, **kw) -> Engine:
    kw = {"page_size": 4, "num_pages": 256, "max_prefill_tokens": 64, **kw}
    return Engine.from_pretrained(ckpt, **kw)


@pytest.fixture(scope="module")
def engine(ckpt):
    return make_engine(ckpt)


@pytest.fixture(scope="module")
def greedy_ref(engine):
    """Each prompt run alone, prefix cache off: the reference for batching, chunking, caching, PD."""
    solo = Engine(engine.model, page_size=4, num_pages=256, enable_prefix_cache=False)
    return [solo.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def assert_no_leak(engine: Engine) -> None:
    engine.flush_prefix_cache()
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"], stats
    assert not engine.requests and not engine.pinned and not engine.reservations


def test_greedy_matches_hf_generate(engine, hf, greedy_ref):
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out, solo in zip(PROMPTS, outs, greedy_ref, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == ref.tolist() == solo
        assert out.finish_reason == "length" and len(out.token_ids) == 32
        assert isinstance(out.text, str)
    assert_no_leak(engine)


def test_prefill_logits_match_hf_with_and_without_chunking(ckpt, engine, hf):
    tokens = PROMPTS[2]
    ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(engine.prefill_logits(tokens), ref, atol=1e-4, rtol=0)
    chunked = Engine(engine.model, page_size=4, num_pages=64, max_prefill_tokens=5)
    torch.testing.assert_close(chunked.prefill_logits(tokens), ref, atol=1e-4, rtol=0)
    assert_no_leak(chunked)


def test_incremental_decode_equals_full_recompute(engine):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5)
    (out,) = engine.generate([PROMPTS[0]], params)
    full = engine.prefill_logits(PROMPTS[0] + out.token_ids[:-1])
    logp = full[len(PROMPTS[0]) - 1 :].log_softmax(-1)
    assert out.token_ids == logp.argmax(-1).tolist()
    assert out.logprobs is not None and len(out.logprobs) == 24
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(logp[i, lp.token_id].item(), abs=1e-4)
        vals, ids = logp[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)
    assert_no_leak(engine)


def test_prefix_cache_hit_gives_identical_logits(ckpt, engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=20)
    base = PROMPTS[2]  # 25 tokens: 6 full pages once run
    (first,) = engine.generate([base], params)
    assert first.cached_tokens == 0
    extended = base + first.token_ids + [9, 8, 7]
    (hit,) = engine.generate([extended], params)
    # prompt + all outputs but the last have KV: 30 tokens -> 7 whole pages = 28 cached tokens
    assert hit.cached_tokens == 28
    cold = Engine(engine.model, page_size=4, num_pages=256, enable_prefix_cache=False)
    (miss,) = cold.generate([extended], params)
    assert hit.token_ids == miss.token_ids and miss.cached_tokens == 0
    assert hit.logprobs is not None and miss.logprobs is not None
    for a, b in zip(hit.logprobs, miss.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    assert_no_leak(engine)


def test_joining_and_leaving_between_steps_matches_solo_runs(engine, greedy_ref):
    lengths = {"a": 32, "b": 5, "c": 32, "d": 17}
    prompts = dict(zip("abcd", PROMPTS, strict=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    done: dict[str, str] = {}

    def add(rid):
        engine.add_request(
            rid, prompts[rid], SamplingParams(max_tokens=lengths[rid], temperature=0, ignore_eos=True)
        )

    add("a")
    schedule = {2: "b", 3: "c", 9: "d"}  # joins at these steps; b and d leave early
    for step in range(200):
        if step in schedule:
            add(schedule[step])
        for out in engine.step():
            tokens[out.rid] += out.token_ids
            if out.finished:
                done[out.rid] = out.finish_reason
        if not engine.has_unfinished() and step > max(schedule):
            break
    assert done == {rid: "length" for rid in prompts}
    for i, rid in enumerate("abcd"):
        assert tokens[rid] == greedy_ref[i][: lengths[rid]], rid
    assert_no_leak(engine)


def test_small_budgets_chunking_and_preemption_keep_tokens(ckpt, engine, greedy_ref):
    # 4 prompts of up to 25 tokens + 32 outputs in a 30-page pool, 6-token prefill budget, 3 seqs at once
    tight = Engine(engine.model, page_size=4, num_pages=30, max_num_seqs=3, max_prefill_tokens=6)
    outs = tight.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == greedy_ref
    assert tight.stats()["preemptions"] > 0
    assert_no_leak(tight)


def test_seeded_sampling(engine):
    prompts = PROMPTS[:2]
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    one = engine.generate(prompts, p)
    two = engine.generate(prompts[::-1], p)  # other batch order, same seeds -> same tokens
    assert [o.token_ids for o in one] == [o.token_ids for o in two[::-1]]
    other = engine.generate(prompts, SamplingParams(**{**_fields(p), "seed": 12}))
    assert [o.token_ids for o in other] != [o.token_ids for o in one]
    topk1 = engine.generate(prompts, SamplingParams(max_tokens=16, top_k=1, temperature=0.8, ignore_eos=True))
    greedy = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in topk1] == [o.token_ids for o in greedy]
    assert_no_leak(engine)


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_stop_token_ids_eos_and_stop_strings(engine, greedy_ref):
    ref = greedy_ref[0]
    stop_tok = ref[5]
    cut = ref.index(stop_tok) + 1
    (out,) = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[stop_tok])
    )
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_tok

    saved = engine.eos_ids
    engine.eos_ids = (stop_tok,)
    try:
        (eos,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0))
        (ign,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    finally:
        engine.eos_ids = saved
    assert eos.token_ids == ref[:cut] and eos.finish_reason == "stop"
    assert ign.token_ids == ref and ign.finish_reason == "length"

    tok = engine.tokenizer
    full_text = tok.decode(ref)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert stop.strip(), full_text
    (s,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0, stop=[stop]))
    assert s.finish_reason == "stop" and s.stop_reason == stop
    assert s.text == full_text[: full_text.index(stop)]
    assert ref[: len(s.token_ids)] == s.token_ids and len(s.token_ids) < 32
    assert stop in tok.decode(s.token_ids) and stop not in tok.decode(s.token_ids[:-1])
    assert_no_leak(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], GREEDY, "empty"),
        ([1, 2, 10**6], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        ([1] * 500, SamplingParams(max_tokens=20), "context length of 512"),
        ([1] * 513, SamplingParams(max_tokens=1), "context length"),
        ("hello", GREEDY, "list of token ids"),
    ],
)
def test_bad_input_is_a_clear_error(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], params)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()
    assert_no_leak(engine)


def test_other_bad_calls(engine):
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate([[1, 2]], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="pool has only"):
        Engine(engine.model, page_size=4, num_pages=4).generate([[1] * 10], SamplingParams(max_tokens=10))
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], GREEDY)
    assert engine.abort("dup") and not engine.abort("dup")
    with pytest.raises(ValueError, match="no reservation"):
        engine.add_prefilled("x", [1, 2], 3, GREEDY)
    assert_no_leak(engine)


def test_no_leaked_pages_on_abort_and_error(engine, monkeypatch):
    for steps in range(4):  # abort while waiting, mid-prefill, decoding
        tiny_budget = Engine(engine.model, page_size=4, num_pages=64, max_prefill_tokens=8)
        tiny_budget.add_request("a", PROMPTS[2], GREEDY)
        tiny_budget.add_request("b", PROMPTS[0], GREEDY)
        for _ in range(steps):
            tiny_budget.step()
        assert tiny_budget.abort("a") and tiny_budget.abort("b")
        assert not tiny_budget.has_unfinished()
        assert_no_leak(tiny_budget)

    calls = {"n": 0}
    real = engine.runner.forward_last

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward_last", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(PROMPTS, GREEDY)
    assert not engine.has_unfinished()
    assert_no_leak(engine)


def test_pd_reserve_add_prefilled_matches_single_engine(ckpt, engine, greedy_ref):
    """Prefill on one engine, copy its KV rows into pages reserved on another, decode there."""
    prefill_side = make_engine(ckpt, num_pages=64)
    decode_side = make_engine(ckpt, num_pages=64)
    prefill_side.generate([PROMPTS[2][:13]], SamplingParams(max_tokens=1))  # warm its prefix cache
    seeded = SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=True)
    (seeded_ref,) = engine.generate([PROMPTS[3]], seeded)
    cases = {
        "p0": (PROMPTS[2], GREEDY, greedy_ref[2], 12),
        "p1": (PROMPTS[1], GREEDY, greedy_ref[1], 0),
        "p2": (PROMPTS[3], seeded, seeded_ref.token_ids, 0),
    }
    src = prefill_side.kv_pool.buffer.view(prefill_side.kv_pool.num_layers, 64, 4, -1)
    dst = decode_side.kv_pool.buffer.view(decode_side.kv_pool.num_layers, 64, 4, -1)
    tokens = {}
    for rid, (prompt, params, ref, cached) in cases.items():
        res = prefill_side.prefill(rid, prompt, params)
        assert res.first_token == ref[0] and res.cached_tokens == cached
        pages = decode_side.reserve(rid, len(prompt))
        assert len(pages) == len(res.page_ids)
        dst[:, pages] = src[:, res.page_ids]  # what the KV transfer does, by KVPool rows
        prefill_side.release(rid)
        decode_side.add_prefilled(rid, prompt, res.first_token, params)
        tokens[rid] = [res.first_token]
    while decode_side.has_unfinished():
        for out in decode_side.step():
            tokens[out.rid] += out.token_ids
    assert tokens == {rid: case[2] for rid, case in cases.items()}
    assert_no_leak(prefill_side)
    assert_no_leak(decode_side)


def test_pd_first_token_can_finish_and_reservations_cancel(ckpt, engine, greedy_ref):
    decode_side = make_engine(ckpt, num_pages=16)
    decode_side.reserve("r", 10)
    assert decode_side.stats()["free_pages"] == 16 - 3
    decode_side.add_prefilled("r", PROMPTS[0], 42, SamplingParams(max_tokens=1))
    outs = decode_side.step()
    assert [(o.rid, o.token_ids, o.finish_reason) for o in outs] == [("r", [], "length")]
    decode_side.reserve("s", 10)
    assert decode_side.cancel_reservation("s")
    with pytest.raises(ValueError, match="num_tokens"):
        decode_side.reserve("t", 0)
    assert_no_leak(decode_side)


def test_generation_output_type(engine):
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert isinstance(out, GenerationOutput) and out.logprobs is None


def _walks_with_a_full_pool(engine: Engine, evict_min_pages: int, greedy_ref) -> list[int]:
    """Fill a 64-page pool with cached prompts, then run PROMPTS (their tokens checked): what each eviction
    walk of the tree was asked for."""
    small = Engine(engine.model, page_size=4, num_pages=64)
    small.evict_min_pages = evict_min_pages
    assert small.cache is not None
    walks: list[int] = []
    evict = small.cache.evict
    small.cache.evict = lambda n: walks.append(n) or evict(n)  # type: ignore[method-assign]
    filler = 0
    while small.allocator.num_free >= 6:  # finished prompts stay cached: 5 distinct pages each
        prompt = [100 + 7 * filler + j for j in range(20)]
        small.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        filler += 1
    assert walks == [] and small.cache.cached_pages > 40  # full of cache, nothing evicted yet
    outs = small.generate([list(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == greedy_ref
    assert small.stats()["used_pages"] == small.cache.cached_pages  # nothing held but the cache
    return walks


def test_a_full_pool_evicts_a_batch_of_cached_pages_per_walk(engine, greedy_ref):
    """With the pool full of cached prompts, the allocation that finds no free page evicts at least
    evict_min_pages (least recently used leaves first) in one walk of the tree, so the allocations after it
    find free pages: fewer walks than evicting only what each allocation lacks."""
    assert Engine(engine.model, page_size=4, num_pages=640).evict_min_pages == 10  # 1/64 of the pool
    one = _walks_with_a_full_pool(engine, 1, greedy_ref)
    batch = _walks_with_a_full_pool(engine, 16, greedy_ref)
    assert batch and all(n >= 16 for n in batch)
    assert len(batch) < len(one), (batch, one)
