"""The gateway's generation routes at the ASGI level (`_GenerationRoutes`): a POST to /v1/completions or
/v1/chat/completions goes to the handler without the app behind it, and a failure there is answered as the
app's exception handlers answer it; anything else goes on to the app."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from services.gateway import app as gateway_app
from services.gateway.errors import ApiError, error_body

RETRY_AFTER_S = 7


def scope(method: str, path: str) -> dict[str, Any]:
    ctx = SimpleNamespace(settings=SimpleNamespace(retry_after_s=RETRY_AFTER_S))
    return {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"",
            "app": SimpleNamespace(state=SimpleNamespace(ctx=ctx))}  # fmt: skip


async def call(routes: Any, method: str, path: str) -> tuple[int, dict[str, str], Any]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await routes(scope(method, path), receive, send)
    start = sent[0]
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], headers, json.loads(body) if body else None


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list, list, list]:
    handled: list[tuple[Any, bool]] = []  # (ctx, chat) per call of the handler
    passed: list[tuple[str, str]] = []  # (method, path) the app behind got
    failure: list[Exception] = []

    async def generate(ctx: Any, request: Any, chat: bool) -> JSONResponse:
        handled.append((ctx, chat))
        if failure:
            raise failure[0]
        return JSONResponse({"chat": chat})

    async def app(scope: dict, receive: Any, send: Any) -> None:
        passed.append((scope["method"], scope["path"]))
        await JSONResponse({"app": True})(scope, receive, send)

    monkeypatch.setattr(gateway_app, "_generate", generate)
    return gateway_app._GenerationRoutes(app, ctx="the-ctx"), handled, passed, failure


async def test_a_generation_post_goes_to_the_handler_and_everything_else_to_the_app(routes) -> None:
    r, handled, passed, _ = routes
    assert await call(r, "POST", "/v1/completions") == (200, {"content-length": "14", "content-type":
                                                            "application/json"}, {"chat": False})  # fmt: skip
    assert (await call(r, "POST", "/v1/chat/completions"))[2] == {"chat": True}
    assert handled == [("the-ctx", False), ("the-ctx", True)]
    for method, path in (("GET", "/v1/completions"), ("POST", "/v1/completions/"), ("GET", "/v1/models")):
        assert (await call(r, method, path))[2] == {"app": True}
    assert passed == [("GET", "/v1/completions"), ("POST", "/v1/completions/"), ("GET", "/v1/models")]
    assert len(handled) == 2


@pytest.mark.parametrize(
    ("error", "status", "body", "retry_after"),
    [
        (
            ApiError(429, "too many", code="overloaded"),
            429,
            error_body(429, "too many", code="overloaded"),
            "7",
        ),
        (ApiError(400, "bad", param="n"), 400, error_body(400, "bad", param="n"), None),
        (HTTPException(413, "too large"), 413, error_body(413, "too large"), None),
        (RuntimeError("boom"), 500, error_body(500, "internal error: RuntimeError"), None),
    ],
)
async def test_a_failure_is_answered_as_the_apps_exception_handlers_answer_it(
    routes, error: Exception, status: int, body: dict, retry_after: str | None
) -> None:
    r, _, passed, failure = routes
    failure.append(error)
    got_status, headers, got_body = await call(r, "POST", "/v1/chat/completions")
    assert (got_status, got_body, headers.get("retry-after")) == (status, body, retry_after)
    assert passed == []


async def test_a_client_gone_while_generating_ends_without_a_body(routes) -> None:
    r, _, _, failure = routes
    failure.append(ApiError(gateway_app.CLIENT_GONE, "client disconnected"))
    assert await call(r, "POST", "/v1/completions") == (
        gateway_app.CLIENT_GONE,
        {"content-length": "0"},
        None,
    )
