"""The gateway's OpenAPI document with real request bodies.

The routes read and validate their bodies themselves (app.py: OpenAI's 400s, size limits while
reading), so FastAPI cannot infer the bodies; this puts the pydantic request models and the possible
error statuses into /openapi.json, so clients and API fuzzers (schemathesis) see the actual contract.
"""

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
    if ctx is not None:  # one model is served; any other name is a 404
        for model in _BODIES.values():
            schemas[model]["properties"]["model"] = {"type": "string", "enum": [ctx.info.name]}
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


def install_openapi(app: FastAPI) -> None:
    """Serve `openapi_document` at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
