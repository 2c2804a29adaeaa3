"""The request's output constraints as wire values: structured output (`proto.messages.Guided`) and logit bias."""

# Structured output comes from OpenAI's `response_format` (json_object, json_schema) or vLLM's extras
# (`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or `structured_outputs`); at most one
# may be given. The gateway checks shape only (it never imports the grammar engine, which needs torch): a
# schema or regex the grammar engine cannot compile comes back from the worker as a 400.

from __future__ import annotations

import json
from typing import Any

from proto.messages import Guided
from services.gateway.errors import ApiError, bad_param
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

Request = ChatCompletionRequest | CompletionRequest


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_param(param, f"not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise bad_param(param, "a JSON schema must be a JSON object")
    return json.dumps(schema)


def _choice(choices: list[str], param: str) -> Guided:
    if not choices or any(not c for c in choices):
        raise bad_param(param, "needs a non-empty list of non-empty strings")
    return Guided("choice", json.dumps(choices))


def _candidates(req: Request) -> list[tuple[str, Guided]]:
    found: list[tuple[str, Guided]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Guided("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_param("response_format", "type json_schema needs json_schema.schema")
        found.append(
            ("response_format", Guided("json", _schema_text(rf.json_schema.json_schema, "response_format")))
        )
    if req.guided_json is not None:
        found.append(("guided_json", Guided("json", _schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", Guided("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", Guided("grammar", req.guided_grammar)))
    so = req.structured_outputs
    if so is not None:
        parts = [
            Guided("json", _schema_text(so.json_, "structured_outputs")) if so.json_ is not None else None,
            Guided("regex", so.regex) if so.regex is not None else None,
            _choice(so.choice, "structured_outputs") if so.choice is not None else None,
            Guided("grammar", so.grammar) if so.grammar is not None else None,
            Guided("json_object") if so.json_object else None,
        ]
        found += [("structured_outputs", g) for g in parts if g is not None]
    return found


def guided_of(req: Request, extra: Guided | None = None) -> Guided | None:
    """The one structured-output constraint of the request (`extra`: one the gateway adds itself, e.g.
    for a required tool call); 400 if several are given."""
    found = _candidates(req) + ([("tool_choice", extra)] if extra is not None else [])
    if len(found) > 1:
        names = ", ".join(sorted({name for name, _ in found}))
        raise ApiError(
            400, f"only one structured-output constraint may be given, got: {names}", param=found[1][0]
        )
    return found[0][1] if found else None


def logit_bias_of(req: Request, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}) with ids checked against the vocabulary and biases
    clamped to [-100, 100] (as vLLM does)."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_param("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= tid < vocab_size:
            raise bad_param("logit_bias", f"token id {tid} is out of range for a vocabulary of {vocab_size}")
        out[tid] = max(-100.0, min(100.0, float(bias)))
    return out
