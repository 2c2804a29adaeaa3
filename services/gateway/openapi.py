"""The gateway's OpenAPI document with real request bodies."""

# The routes read and validate their bodies themselves (app.py: OpenAI's 400s, size limits while
# reading), so FastAPI cannot infer the bodies; this puts the pydantic request models and the possible
# error statuses into /openapi.json, so clients and API fuzzers (schemathesis) see the actual contract:
# parameters accepted at their neutral value only (schemas.py, `check_unsupported`) are documented as
# such, and a prompt's token ids are bounded by the served model's vocabulary.

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

_BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
_ERRORS = {
    "400": "invalid request", "401": "missing or invalid API key", "404": "unknown model",
    "413": "body too large", "429": "queue full or overloaded (Retry-After)",
    "503": "no scheduler or worker available (Retry-After)", "504": "not finished before the request deadline",
}  # fmt: skip
_NULL = {"type": "null"}
# OpenAI parameters the mesh accepts only at their neutral value (anything else is a 400)
_NEUTRAL_ONLY: dict[str, dict[str, Any]] = {
    "presence_penalty": {"type": "number", "const": 0, "default": 0},
    "frequency_penalty": {"type": "number", "const": 0, "default": 0},
    "logit_bias": {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]},
    "echo": {"type": "boolean", "const": False, "default": False},
    "suffix": {"anyOf": [{"type": "string", "maxLength": 0}, _NULL]},
    "tools": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
    "tool_choice": {"anyOf": [{"const": "none"}, _NULL]},
    "response_format": {
        "anyOf": [{"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}}, _NULL]
    },
}
_ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"]}},
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    ctx = getattr(app.state, "ctx", None)
    for model in _BODIES.values():
        props = schemas[model]["properties"]
        props.update({k: v for k, v in _NEUTRAL_ONLY.items() if k in props})
        if ctx is not None:  # one model is served; any other name is a 404
            props["model"] = {"type": "string", "enum": [ctx.info.name]}
            if "prompt" in props:
                _bound_token_ids(props["prompt"], ctx.info.vocab_size)
    for path, model in _BODIES.items():
        op = doc["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
        }
        op["responses"] = {
            "200": {"description": "the completion (JSON), or an SSE stream when `stream` is true"},
            **{code: {"description": why, "content": {"application/json": {"schema": _ERROR_BODY}}}
               for code, why in _ERRORS.items()},
        }  # fmt: skip
    return doc


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """A prompt's token ids (integers from 0) lie below the vocabulary size."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _bound_token_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab_size)


def install_openapi(app: FastAPI) -> None:
    """Serve `openapi_document` at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
