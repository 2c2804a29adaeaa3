"""Dataset generators: lengths, range ratio, shared prefixes, seeds, JSONL files."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from libs.loadgen.datasets import (
    BenchRequest,
    load_jsonl,
    random_requests,
    sample_lengths,
    shared_prefix_requests,
    to_text,
)


def test_range_ratio_one_fixes_every_length() -> None:
    reqs = random_requests(50, 128, 32, 1.0, vocab_size=1000, seed=0)
    assert {len(r.prompt) for r in reqs} == {128}
    assert {(r.input_len, r.output_len) for r in reqs} == {(128, 32)}


def test_range_ratio_spreads_lengths_over_its_interval_inclusive() -> None:
    reqs = random_requests(400, 100, 40, 0.5, vocab_size=1000, seed=1)
    ins = [r.input_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) == 50 and max(ins) == 100  # [int(100 * 0.5), 100], both ends drawn
    assert min(outs) == 20 and max(outs) == 40
    assert all(len(r.prompt) == r.input_len for r in reqs)


def test_range_ratio_zero_starts_at_one() -> None:
    lens = sample_lengths(np.random.default_rng(0), 2000, 4, 0.0)
    assert set(lens) == {1, 2, 3, 4}


def test_ids_stay_in_the_vocabulary_and_avoid_excluded_ones() -> None:
    reqs = random_requests(20, 200, 4, vocab_size=50, seed=2, exclude_ids={0, 1, 2})
    ids = {t for r in reqs for t in r.prompt}
    assert ids <= set(range(3, 50))
    assert len(ids) > 40  # spread over the vocabulary, not a constant


def test_same_seed_same_prompts_other_seed_other_prompts() -> None:
    a = random_requests(10, 64, 16, 0.3, vocab_size=1000, seed=7)
    assert a == random_requests(10, 64, 16, 0.3, vocab_size=1000, seed=7)
    assert a != random_requests(10, 64, 16, 0.3, vocab_size=1000, seed=8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_prompts=0), "num_prompts"),
        (dict(input_len=0), "length"),
        (dict(range_ratio=1.5), "range_ratio"),
        (dict(vocab_size=3, exclude_ids={0, 1, 2}), "no token id left"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    args = dict(num_prompts=2, input_len=8, output_len=4, range_ratio=1.0, vocab_size=100) | kwargs
    with pytest.raises(ValueError, match=match):
        random_requests(args.pop("num_prompts"), args.pop("input_len"), args.pop("output_len"),
                        args.pop("range_ratio"), **args)  # fmt: skip


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    reqs = shared_prefix_requests(4, 5, 64, 8, 16, vocab_size=1000, seed=3)
    assert len(reqs) == 20
    assert {(len(r.prompt), r.input_len, r.output_len) for r in reqs} == {(72, 72, 16)}
    prefixes = Counter(tuple(r.prompt[:64]) for r in reqs)
    assert sorted(prefixes.values()) == [5, 5, 5, 5]  # 4 distinct system prompts, 5 prompts each
    assert len({tuple(r.prompt[64:]) for r in reqs}) == 20  # questions differ
    order = [list(prefixes).index(tuple(r.prompt[:64])) for r in reqs]
    assert order != sorted(order)  # shuffled: a group's prompts do not come back to back
    assert reqs == shared_prefix_requests(4, 5, 64, 8, 16, vocab_size=1000, seed=3)


def test_jsonl_prompts_text_and_ids(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "hello there"},
        {"prompt": [5, 6, 7], "output_len": 9},
        {"prompt": "x", "max_tokens": 2},
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_jsonl(f, None, default_output_len=4, tokenizer=_WordTokenizer())
    assert reqs == [BenchRequest("hello there", 2, 4), BenchRequest([5, 6, 7], 3, 9), BenchRequest("x", 1, 2)]
    assert load_jsonl(f, 2, 4) == [BenchRequest("hello there", 0, 4), BenchRequest([5, 6, 7], 3, 9)]


@pytest.mark.parametrize(
    ("content", "match"),
    [("{not json", ":1: not valid JSON"), ('{"text": "a"}', "'prompt'"), ('{"prompt": ""}', "empty"),
     ('{"prompt": "a", "output_len": 0}', "output_len"), ("", "holds no prompts")],
)  # fmt: skip
def test_bad_jsonl_is_refused_with_the_line(tmp_path: Path, content: str, match: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_jsonl(f, None, 4)


def test_jsonl_with_fewer_prompts_than_asked_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="fewer than the 3"):
        load_jsonl(f, 3, 4)


def test_to_text_decodes_ids_and_needs_a_tokenizer() -> None:
    reqs = [BenchRequest([1, 2], 2, 4), BenchRequest("already text", 0, 4)]
    assert to_text(reqs, _WordTokenizer()) == [BenchRequest("w1 w2", 2, 4), reqs[1]]
    with pytest.raises(ValueError, match="--tokenizer"):
        to_text(reqs, None)


class _WordTokenizer:
    vocab_size = 100

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)
