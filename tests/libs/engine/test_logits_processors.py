"""Penalties, logit bias, min_tokens and structured output against plain reference code and the tiny model."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.logits_processors import (
    GuidedSpec,
    HostBitmasks,
    LogitsProcessors,
    apply_bitmask,
    unpack_bitmask,
)
from libs.engine.tiny import write_tiny_model

V = 50


@dataclass
class Seq:
    rid: str
    output_ids: list[int] = field(default_factory=list)


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams, eos: list[int]):
    """vLLM's semantics, one row, written as plainly as possible."""
    out = list(logits)
    if len(output) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else eos):
            out[t] = float("-inf")
    for t, b in p.logit_bias:
        out[t] += max(-100.0, min(100.0, b))
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * output.count(t)
        out[t] -= p.presence_penalty * (1.0 if t in output else 0.0)
    return out


def test_batched_processing_matches_reference_over_many_steps():
    rng = random.Random(0)
    procs = LogitsProcessors(V, "cpu", [1], None)
    params = [
        SamplingParams(max_tokens=50, repetition_penalty=1.3),
        SamplingParams(max_tokens=50, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(max_tokens=50),  # untouched: no state at all
        SamplingParams(max_tokens=50, min_tokens=4, stop_token_ids=(7,), logit_bias={3: 5.0, 9: -250.0}),
        SamplingParams(
            max_tokens=50,
            repetition_penalty=0.8,
            frequency_penalty=-1.0,
            presence_penalty=2.0,
            logit_bias={0: 1.5},
            min_tokens=2,
        ),  # fmt: skip
    ]
    seqs = [Seq(f"r{i}") for i in range(len(params))]
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 12))] for _ in params]
    for s, prompt, p in zip(seqs, prompts, params, strict=True):
        procs.add(s.rid, prompt, p)
    assert set(procs.states) == {"r0", "r1", "r3", "r4"}
    for _ in range(8):
        logits = torch.randn(len(seqs), V) * 3
        got = procs.apply(logits, seqs)
        for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
            want = reference(logits[i].tolist(), prompts[i], s.output_ids, p, [1])
            assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
        tokens = [rng.choice([1, 7, rng.randrange(V)]) for _ in seqs]
        procs.accept(seqs, tokens)
        for s, t in zip(seqs, tokens, strict=True):
            s.output_ids.append(t)


def test_no_processing_is_free_and_slots_are_recycled_clean():
    procs = LogitsProcessors(V, "cpu", [1], None)
    logits = torch.randn(2, V)
    procs.add("plain", [1, 2], SamplingParams())
    assert procs.apply(logits, [Seq("plain"), Seq("other")]) is logits  # no copy, no state
    procs.add("a", [4, 5], SamplingParams(presence_penalty=1.0))
    procs.accept([Seq("a")], [6])
    slot = procs.states["a"].slot
    procs.remove("a")
    procs.add("b", [8], SamplingParams(presence_penalty=1.0))
    assert procs.states["b"].slot == slot
    assert procs.counts[slot].sum() == 0 and procs.seen[slot].nonzero().flatten().tolist() == [8]


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="out of range"):
        LogitsProcessors(V, "cpu", [1], None).add("x", [1], SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match="tokenizer"):
        LogitsProcessors(V, "cpu", [1], None).add("x", [1], SamplingParams(guided=GuidedSpec("json_object")))


def test_unpack_bitmask():
    bitmask = torch.tensor([[0b101, -(2**31)], [-1, 1]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]  # token 63 (bit 31 of word 1) is past V
    assert allowed[1].nonzero().flatten().tolist() == list(range(33))


def test_a_batch_plan_is_kept_until_the_batch_or_min_tokens_change():
    """The device tensors of a batch are built once and reused while nothing that shapes them changes; the
    16-bit logits of the model are processed as their float32 cast."""
    procs = LogitsProcessors(V, "cpu", [1], None)
    procs.add("a", [2, 3], SamplingParams(max_tokens=9, min_tokens=2, logit_bias={4: 1.0}))
    procs.add("b", [5], SamplingParams(max_tokens=9, repetition_penalty=1.5))
    seqs = [Seq("a"), Seq("x"), Seq("b")]
    logits = torch.randn(3, V, dtype=torch.bfloat16)
    out = procs.apply(logits, seqs)
    plan = procs._plan
    assert out.dtype == torch.float32 and procs.apply(logits, seqs).equal(out) and procs._plan is plan
    assert out[0, 1] == float("-inf") and out[1].equal(logits[1].float())
    assert out[0, 4] == logits[0, 4].float() + 1.0
    seqs[0].output_ids += [7, 8]  # "a" reaches min_tokens: EOS is allowed again
    assert procs.apply(logits, seqs)[0, 1] == logits[0, 1].float() and procs._plan is not plan
    plan = procs._plan
    procs.accept(seqs, [6, 9, 6])  # counts change on the device; the plan stays
    assert procs.apply(logits, seqs)[2, 6] != logits[2, 6].float() and procs._plan is plan
    procs.remove("b")
    assert procs._plan is None
    assert procs.apply(logits, seqs)[2].equal(logits[2].float())


@pytest.mark.parametrize("xgrammar", [True, False])
def test_bitmask_applies_to_its_rows_only(monkeypatch, xgrammar):
    """xgrammar's kernel on the packed words (or, without xgrammar, the unpacked mask) on a subset of rows."""
    if not xgrammar:
        monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)  # import fails as if not installed
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 2), dtype=torch.int32, generator=g)
    out = logits.clone()
    apply_bitmask(out, bitmask, [1, 3], V)
    allowed = unpack_bitmask(bitmask, V)
    for g_row, row in enumerate([1, 3]):
        want = logits[row].masked_fill(~allowed[g_row], float("-inf"))
        assert out[row].equal(want)
    assert out[[0, 2]].equal(logits[[0, 2]])
    out = logits[:2].clone()
    apply_bitmask(out, bitmask, [0, 1], V)  # every row: no expansion
    assert out.equal(logits[:2].masked_fill(~allowed, float("-inf")))


def test_host_bitmask_buffers_alternate_and_grow():
    """Two buffers in turn (a copy may still read the other), each grown when a batch outgrows it."""
    bufs = HostBitmasks(V, pin=False)
    a, b = bufs.take(3), bufs.take(3)
    assert a.shape == (3, 2) and a.dtype == torch.int32 and a.data_ptr() != b.data_ptr()
    assert bufs.take(2).data_ptr() == a.data_ptr() and bufs.take(3).data_ptr() == b.data_ptr()
    big = bufs.take(40)  # a's turn, too small: a new buffer
    assert big.shape == (40, 2) and big.data_ptr() != a.data_ptr()
    assert bufs.take(3).data_ptr() == b.data_ptr() and bufs.take(40).data_ptr() == big.data_ptr()


# --- through the engine, on the tiny model with its tokenizer ---


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny_lp"), seed=1)
    return Engine.from_pretrained(path, page_size=4, num_pages=512, max_num_seqs=32)


def test_large_logit_bias_forces_a_token_and_logprobs_stay_raw(engine):
    p = SamplingParams(
        max_tokens=6, temperature=1.0, seed=3, logit_bias={42: 100.0}, logprobs=True, ignore_eos=True
    )
    (out,) = engine.generate([[5, 6, 7]], p)
    assert out.token_ids == [42] * 6
    assert out.logprobs is not None and all(lp.logprob < -0.5 for lp in out.logprobs)  # the model's own


def test_min_tokens_delays_eos(engine):
    eos = engine.eos_ids[0]
    force_eos = {eos: 100.0}
    (early,) = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, logit_bias=force_eos)
    )
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    p = SamplingParams(max_tokens=20, temperature=0, logit_bias=force_eos, min_tokens=5)
    (late,) = engine.generate([[5, 6, 7]], p)
    assert len(late.token_ids) == 6 and late.token_ids[-1] == eos and eos not in late.token_ids[:5]


def test_stop_strings_count_only_from_min_tokens(engine):
    a = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    p = SamplingParams(max_tokens=10, temperature=0, logit_bias={a: 100.0}, stop=["a"], min_tokens=3)
    (out,) = engine.generate([[5, 6, 7]], p)
    assert out.token_ids == [a, a, a] and out.text == "aa" and out.stop_reason == "a"
    p = SamplingParams(max_tokens=10, temperature=0, logit_bias={a: 100.0}, stop=["aa"], min_tokens=3)
    (out,) = engine.generate([[5, 6, 7]], p)  # the "aa" of tokens 1-2 is too early; tokens 3-4 stop it
    assert out.token_ids == [a] * 4 and out.text == "aa" and out.stop_reason == "aa"


def test_repetition_penalty_changes_greedy_output_as_the_reference_says(engine):
    prompt = [5, 6, 7, 8, 9]
    p = SamplingParams(
        max_tokens=8, temperature=0, repetition_penalty=1.8, frequency_penalty=0.5, ignore_eos=True
    )
    (out,) = engine.generate([prompt], p)
    tokens: list[int] = []
    for _ in range(8):  # greedy over the reference-processed logits of the full sequence
        logits = engine.prefill_logits(prompt + tokens)[-1].tolist()
        want = reference(logits, prompt, tokens, p, list(engine.eos_ids))
        tokens.append(max(range(len(want)), key=want.__getitem__))
    assert out.token_ids == tokens


SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern rather than maxLength: xgrammar 0.2.9's maxLength form lets raw control characters in
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tag": {"enum": ["a", "b", "c"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tag", "ok"],
    "additionalProperties": False,
}


def valid(doc: object) -> bool:
    return (
        isinstance(doc, dict) and set(doc) == set(SCHEMA["properties"]) and isinstance(doc["name"], str)
        and re.fullmatch("[a-z ]{1,8}", doc["name"]) is not None and type(doc["age"]) is int and 0 <= doc["age"] <= 120
        and doc["tag"] in ("a", "b", "c") and type(doc["ok"]) is bool
    )  # fmt: skip


def test_json_schema_output_validates_every_sample(engine):
    spec = GuidedSpec("json", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, guided=spec) for s in range(16)]
    outs = engine.generate([[5, 6, 7]] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop" and out.text is not None
        assert valid(json.loads(out.text)), out.text
    assert len({o.text for o in outs}) > 1  # sampled, not one forced answer


def test_regex_choice_and_json_object(engine):
    cases = [
        (GuidedSpec("regex", r"[a-c]{2}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        (GuidedSpec("choice", json.dumps(["yes", "no", "maybe"])), lambda t: t in ("yes", "no", "maybe")),
        (GuidedSpec("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, check in cases:
        params = [SamplingParams(max_tokens=30, temperature=0.7, seed=s, guided=spec) for s in range(4)]
        for out in engine.generate([[9, 10]] * 4, params):
            if spec.kind == "json_object" and out.finish_reason == "length":
                continue  # a free JSON object may outgrow max_tokens on a random model
            assert out.finish_reason == "stop" and check(out.text), (spec, out.text)


def test_finished_grammar_under_ignore_eos_allows_only_eos(engine):
    p = SamplingParams(
        max_tokens=12, temperature=1.0, seed=2, ignore_eos=True, guided=GuidedSpec("regex", "ab")
    )
    (out,) = engine.generate([[5, 6]], p)
    eos = engine.eos_ids[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    n = out.token_ids.index(eos)
    assert engine.tokenizer.decode(out.token_ids[:n]) == "ab" and set(out.token_ids[n:]) == {eos}


def test_bad_grammar_is_a_value_error_and_leaks_nothing(engine):
    with pytest.raises(ValueError, match="structured output"):
        engine.add_request("bad", [1, 2], SamplingParams(guided=GuidedSpec("regex", "([a-")))
    assert "bad" not in engine.requests and "bad" not in engine.procs.states


def test_pd_prefill_and_decode_honour_grammar_and_penalties(tmp_path_factory, engine):
    """The prefill side samples the first token under the processors; the decode side continues them."""
    path = write_tiny_model(tmp_path_factory.mktemp("tiny_pd"), seed=1)
    pre = Engine.from_pretrained(path, page_size=4, num_pages=64)
    dec = Engine.from_pretrained(path, page_size=4, num_pages=64)
    spec = GuidedSpec("json", json.dumps(SCHEMA))
    cases = {
        "g": SamplingParams(max_tokens=80, temperature=1.0, seed=11, guided=spec),
        "p": SamplingParams(
            max_tokens=12,
            temperature=0,
            repetition_penalty=1.5,
            presence_penalty=1.0,
            min_tokens=12,
            logit_bias={30: 2.0},
        ),  # fmt: skip
    }
    prompt = [5, 6, 7, 8]
    refs = {rid: engine.generate([prompt], p)[0].token_ids for rid, p in cases.items()}
    src = pre.kv_pool.buffer.view(pre.kv_pool.num_layers, 64, 4, -1)
    dst = dec.kv_pool.buffer.view(dec.kv_pool.num_layers, 64, 4, -1)
    tokens = {}
    for rid, p in cases.items():
        res = pre.prefill(rid, prompt, p)
        pages = dec.reserve(rid, len(prompt))
        dst[:, pages] = src[:, res.page_ids]
        pre.release(rid)
        dec.add_prefilled(rid, prompt, res.first_token, p)
        tokens[rid] = [res.first_token]
    while dec.has_unfinished():
        for out in dec.step():
            tokens[out.rid] += out.token_ids
    assert tokens == refs
    assert not pre.procs.states and not dec.procs.states


def test_a_gated_grammar_starts_after_its_ids(engine):
    """`start_after` (a reasoning model's end-of-thinking ids, split over two tokens here): no mask until
    the output ends with them, the grammar from the next token on; ids that only begin the gate keep it shut."""
    procs = LogitsProcessors(engine.config.vocab_size, "cpu", engine.eos_ids, engine.tokenizer)
    procs._grammars = engine.procs._grammar_backend()  # the engine's compiler: built once per module
    ids = engine.tokenizer.encode("</think>", add_special_tokens=False)
    gate = (ids[0], ids[-1]) if len(ids) > 1 else (5, ids[0])
    procs.add("r", [2], SamplingParams(max_tokens=30, guided=GuidedSpec("regex", "ab", gate)))
    seq = Seq("r")
    logits = torch.zeros(1, engine.config.vocab_size)
    for tok in [7, gate[0], 9, gate[-1]]:  # reasoning, with a false start of the gate
        assert procs.apply(logits, [seq]).isfinite().all()
        procs.accept([seq], [tok])
        seq.output_ids.append(tok)
    procs.accept([seq], [gate[0]])  # any token is accepted while the gate is shut
    seq.output_ids.append(gate[0])
    procs.accept([seq], [gate[-1]])
    seq.output_ids.append(gate[-1])
    allowed = procs.apply(logits, [seq])[0].isfinite().nonzero().flatten().tolist()
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert "a" in texts and all(t and "ab".startswith(t) for t in texts), texts
    with pytest.raises(ValueError, match="grammar"):
        procs.accept([seq], [gate[0]])


def test_a_gated_grammar_through_the_engine(engine):
    """A biased gate token comes first (the grammar is off until then), the constrained answer after it;
    without the gate the grammar masks that token from the first step."""
    z = engine.tokenizer.encode("z", add_special_tokens=False)[0]
    p = SamplingParams(max_tokens=12, temperature=0, logit_bias={z: 100.0},
                       guided=GuidedSpec("regex", "ab", (z,)))  # fmt: skip
    (gated,) = engine.generate([[5, 6]], p)
    assert gated.text == "zab" and gated.finish_reason == "stop"
    (plain,) = engine.generate([[5, 6]], SamplingParams(max_tokens=12, temperature=0, logit_bias={z: 100.0},
                                                       guided=GuidedSpec("regex", "ab")))  # fmt: skip
    assert plain.text == "ab"
