"""Batched PD prefill (`Engine.add_prefill` + `step`) against one-at-a-time `Engine.prefill` on the same
weights: the same first tokens and the same KV rows in each prompt's pinned pages, in fewer forwards;
pages stay pinned until release, and every way out frees them."""

from __future__ import annotations

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model

GREEDY = SamplingParams(max_tokens=1, temperature=0)
SEEDED = SamplingParams(max_tokens=1, temperature=1.0, seed=11)
PAGE = 4


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 900 + 3 for i in range(n)]


# lengths around the 24-token budget: one prompt needs three chunks, two share a forward with others
PROMPTS = [prompt(50, 1), prompt(9, 2), prompt(17, 3), prompt(3, 4), prompt(30, 5)]
CACHED = prompt(12, 6)  # both engines hold its first 12 tokens in the cache before the batch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Engine.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=2)).model


def make(model, num_pages: int = 128) -> Engine:
    return Engine(model, page_size=PAGE, num_pages=num_pages, max_prefill_tokens=24, max_num_seqs=8)


def rows(engine: Engine, pages: list[int], n: int) -> torch.Tensor:
    idx = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])[:n]
    return engine.kv_pool.buffer[:, idx].clone()


def assert_no_leak(engine: Engine) -> None:
    engine.flush_prefix_cache()
    st = engine.stats()
    assert st["free_pages"] == st["total_pages"], st
    assert not engine.requests and not engine.pinned and not engine.has_unfinished()


def count_forwards(engine: Engine) -> list[int]:
    """Every model forward the engine's runner makes, as the number of sequences in it."""
    calls: list[int] = []
    real = engine.runner.forward_last

    def counted(chunks, *a, **kw):
        calls.append(len(chunks))
        return real(chunks, *a, **kw)

    engine.runner.forward_last = counted  # type: ignore[method-assign]
    return calls


def run_batched(engine: Engine, items: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (p, params) in items.items():
        engine.add_prefill(rid, p, params)
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.prefill is not None and out.token_ids == [out.prefill.first_token]
            got[out.rid] = out.prefill
    return got


def test_batched_prefill_equals_single_prefill(model) -> None:
    single, batched = make(model), make(model)
    for e in (single, batched):
        e.generate([CACHED + [5]], GREEDY)  # the same cached prefix in both
    items = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    items["seeded"] = (PROMPTS[2], SEEDED)
    items["cached"] = (CACHED + prompt(10, 7), GREEDY)
    want = {rid: single.prefill(rid, p, params) for rid, (p, params) in items.items()}
    forwards = count_forwards(batched)
    got = run_batched(batched, items)
    assert len(forwards) < len(items) and max(forwards) > 1  # prompts shared forwards
    assert got.keys() == want.keys()
    for rid, (p, _) in items.items():
        g, w = got[rid], want[rid]
        assert (g.first_token, g.cached_tokens) == (w.first_token, w.cached_tokens), rid
        assert len(g.page_ids) == len(w.page_ids) == -(-len(p) // PAGE)
        torch.testing.assert_close(rows(batched, g.page_ids, len(p)), rows(single, w.page_ids, len(p)),
                                   rtol=0, atol=1e-5, msg=rid)  # fmt: skip
    assert got["cached"].cached_tokens == 12
    assert batched.stats()["pinned"] == len(items)
    # pinned pages are neither reused nor evicted by later work; release frees them
    before = {rid: rows(batched, r.page_ids, len(items[rid][0])) for rid, r in got.items()}
    batched.generate([prompt(60, 9)], SamplingParams(max_tokens=3, temperature=0))
    batched.flush_prefix_cache()
    for rid, r in got.items():
        assert torch.equal(rows(batched, r.page_ids, len(items[rid][0])), before[rid]), rid
        assert batched.release(rid)
    for rid in items:
        single.release(rid)
    assert_no_leak(batched)
    assert_no_leak(single)


def test_prefills_and_ordinary_requests_share_steps(model) -> None:
    """A decode batch and PD prefills in the same engine: the requests' tokens are those of a solo run."""
    solo = make(model).generate([PROMPTS[1]], SamplingParams(max_tokens=5, temperature=0))[0].token_ids
    e = make(model)
    e.add_request("gen", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0))
    e.add_prefill("pd", PROMPTS[0], GREEDY)
    tokens, prefilled = [], None
    while e.has_unfinished():
        for out in e.step():
            if out.prefill is not None:
                prefilled = out.prefill
            else:
                tokens += out.token_ids
    assert tokens == solo and prefilled is not None
    assert e.stats()["pinned"] == 1 and e.release("pd")
    assert_no_leak(e)


def test_abort_bad_input_and_a_full_pool(model) -> None:
    e = make(model, num_pages=20)  # 80 tokens
    with pytest.raises(ValueError, match="empty"):
        e.add_prefill("bad", [], GREEDY)
    assert not e.has_unfinished()
    e.add_prefill("a", PROMPTS[0], GREEDY)  # 50 tokens: three chunks
    e.step()
    assert e.abort("a")  # mid-prompt
    assert_no_leak(e)
    got = run_batched(e, {"b": (PROMPTS[0], GREEDY)})  # 13 pages pinned
    e.add_prefill("c", PROMPTS[4], GREEDY)  # 30 tokens need 8 pages: waits for the release
    assert e.step() == [] and e.stalled
    assert e.release("b")
    got |= run_batched(e, {})
    assert set(got) == {"b", "c"} and not e.stalled
    assert e.release("c") and not e.release("c")
    assert_no_leak(e)


def test_prefill_progress_names_the_pages_later_chunks_leave_alone(model) -> None:
    """After each step a prompt's whole computed pages are final: later chunks do not change their rows."""
    e = make(model)
    long = PROMPTS[0]  # 50 tokens, chunks of 24: pages final after each step 6, 12, then the result
    e.add_prefill("a", long, GREEDY)
    assert e.prefill_progress("a") == []  # waiting
    seen = []
    while e.has_unfinished():
        outs = e.step()
        if outs:
            result = outs[0].prefill
            break
        pages = e.prefill_progress("a")
        seen.append((len(pages), pages, rows(e, pages, len(pages) * PAGE)))
    assert result is not None and [n for n, _, _ in seen] == [6, 12]
    assert e.prefill_progress("a") == []  # reported: pinned, out of the batch
    for n, pages, before in seen:
        assert pages == result.page_ids[:n]
        assert torch.equal(rows(e, pages, n * PAGE), before)
    assert e.release("a")
    e.add_prefill("b", PROMPTS[4], GREEDY)  # 30 tokens: mid-prompt after one step
    e.step()
    assert e.prefill_progress("b") and e.abort("b") and e.prefill_progress("b") == []
    assert_no_leak(e)
