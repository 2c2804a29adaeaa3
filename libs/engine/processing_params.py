"""What a request asks of the logits processors, and its checks: the structured-output constraint
(`GuidedSpec`), logit-bias bounds, which requests need processing; kept apart from logits_processors and
grammar so sampling.py validates SamplingParams without importing either (`p` is duck-typed)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; vLLM clamps to it


@dataclass(frozen=True)
class GuidedSpec:
    """A structured-output constraint: `kind` one of GUIDED_KINDS; `value` a JSON schema (json), a regex,
    a JSON list of strings (choice), an EBNF grammar (grammar) or "" (json_object). With `start_after`
    (the reasoning's end marker as token ids) it applies only to the output after those ids."""

    kind: str
    value: str = ""
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"structured output kind must be one of {GUIDED_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output value must be a string, got {type(self.value).__name__}")
        if not all(isinstance(t, int) and t >= 0 for t in self.start_after):
            raise ValueError(f"structured output start_after must be token ids, got {self.start_after!r}")


def validate_processing(p: Any) -> None:
    """Range checks of the processing fields of SamplingParams (ValueError naming the field)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_number(v) or not -2.0 <= v <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
    if not _is_number(p.repetition_penalty) or not 0 < p.repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2], got {p.repetition_penalty!r}")
    if not isinstance(p.min_tokens, int) or isinstance(p.min_tokens, bool) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    for item in p.logit_bias:
        ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int) and item[0] >= 0
        if not ok or not _is_number(item[1]) or not math.isfinite(item[1]):
            raise ValueError(f"logit_bias must map token ids >= 0 to finite numbers, got {item!r}")
    if p.guided is not None and not isinstance(p.guided, GuidedSpec):
        raise ValueError(f"guided must be a GuidedSpec, got {p.guided!r}")


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def uses_penalties(p: Any) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def needs_processing(p: Any) -> bool:
    return uses_penalties(p) or bool(p.logit_bias) or p.min_tokens > 0 or p.guided is not None


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of `choices` (vLLM's guided_choice)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
