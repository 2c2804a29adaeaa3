"""Benchmark prompts: random token ids, shared-prefix groups, or a JSONL file."""

# Lengths follow SGLang's bench_serving: with `range_ratio` r, an input (or output) length is drawn
# uniformly from [max(int(L * r), 1), L], both ends included, so r = 1 fixes every length at L and
# r = 0 spreads them over [1, L]. Every generator takes a seed and uses its own numpy Generator, so the
# same arguments give the same prompts in any process.
#
# Prompts are token ids where they can be (random, shared-prefix): an OpenAI completions server takes
# them as-is, so the input length is exact without a tokenizer. A chat endpoint needs text: `to_text`
# decodes the ids with the model's tokenizer (the server's own count then comes back in `usage`).

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: text or token ids, its length in tokens (0: unknown) and max_tokens."""

    prompt: str | list[int]
    input_len: int
    output_len: int


class TextTokenizer(Protocol):
    """What the datasets need from a tokenizer (libs.tokenizer.Tokenizer fits)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _allowed_ids(vocab_size: int, exclude: Iterable[int]) -> np.ndarray:
    _positive("vocab_size", vocab_size)
    ids = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude, dtype=np.int64))
    if ids.size == 0:
        raise ValueError(f"no token id left to sample from a vocabulary of {vocab_size} after exclusions")
    return ids


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [max(int(length * range_ratio), 1), length] (SGLang's --random-range-ratio)."""
    _positive("length", length)
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio!r}")
    low = max(int(length * range_ratio), 1)
    return [int(x) for x in rng.integers(low, length + 1, size=n)]


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    *,
    vocab_size: int,
    seed: int = 0,
    exclude_ids: Iterable[int] = (),
) -> list[BenchRequest]:
    """Prompts of random token ids (special tokens can be left out through `exclude_ids`)."""
    _positive("num_prompts", num_prompts)
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(vocab_size, exclude_ids)
    ins = sample_lengths(rng, num_prompts, input_len, range_ratio)
    outs = sample_lengths(rng, num_prompts, output_len, range_ratio)
    return [
        BenchRequest(allowed[rng.integers(0, allowed.size, size=n)].tolist(), n, o)
        for n, o in zip(ins, outs, strict=True)
    ]


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    *,
    vocab_size: int,
    seed: int = 0,
    exclude_ids: Iterable[int] = (),
) -> list[BenchRequest]:
    """Groups of prompts that share a long random prefix (a system prompt) and differ in a short
    random question: after the first prompt of a group, a prefix cache can skip the shared part.
    The order is shuffled (seeded) so that a group's prompts do not arrive back to back."""
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group)):
        _positive(name, v)
    for name, v in (("system_prompt_len", system_prompt_len), ("question_len", question_len)):
        _positive(name, v)
    _positive("output_len", output_len)
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(vocab_size, exclude_ids)
    out: list[BenchRequest] = []
    for _ in range(num_groups):
        prefix = allowed[rng.integers(0, allowed.size, size=system_prompt_len)].tolist()
        for _ in range(prompts_per_group):
            question = allowed[rng.integers(0, allowed.size, size=question_len)].tolist()
            out.append(BenchRequest(prefix + question, system_prompt_len + question_len, output_len))
    return [out[i] for i in rng.permutation(len(out))]


def _jsonl_record(
    obj: Any, where: str, default_output_len: int, tokenizer: TextTokenizer | None
) -> BenchRequest:
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise ValueError(f"{where}: each line must be a JSON object with a 'prompt'")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: 'prompt' is empty")
        input_len = len(tokenizer.encode(prompt)) if tokenizer is not None else 0
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        input_len = len(prompt)
    else:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")
    out_len = obj.get("output_len", obj.get("max_tokens", default_output_len))
    if not isinstance(out_len, int) or out_len < 1:
        raise ValueError(f"{where}: 'output_len' must be a positive integer, got {out_len!r}")
    return BenchRequest(prompt, input_len, out_len)


def load_jsonl(
    path: str | Path, num_prompts: int | None, default_output_len: int, tokenizer: TextTokenizer | None = None
) -> list[BenchRequest]:
    """Prompts from a JSONL file, one object a line: `{"prompt": "text" | [ids], "output_len": N}`
    (`output_len` optional, `max_tokens` also read). The first `num_prompts` lines are used (all when
    None); a file with fewer is an error rather than a smaller benchmark than asked for."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset file {p} does not exist")
    out: list[BenchRequest] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_prompts is not None and len(out) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON: {e}") from None
            out.append(_jsonl_record(obj, f"{p}:{lineno}", default_output_len, tokenizer))
    if not out:
        raise ValueError(f"{p} holds no prompts")
    if num_prompts is not None and len(out) < num_prompts:
        raise ValueError(f"{p} holds {len(out)} prompts, fewer than the {num_prompts} asked for")
    return out


def to_text(requests: Sequence[BenchRequest], tokenizer: TextTokenizer | None) -> list[BenchRequest]:
    """Token-id prompts decoded to text (a chat endpoint takes only text); text prompts unchanged."""
    if any(not isinstance(r.prompt, str) for r in requests) and tokenizer is None:
        raise ValueError("token-id prompts need --tokenizer to become text for the openai-chat backend")
    return [
        r if isinstance(r.prompt, str) else replace(r, prompt=tokenizer.decode(r.prompt))  # type: ignore[union-attr]
        for r in requests
    ]
