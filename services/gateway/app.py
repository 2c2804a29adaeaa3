"""The OpenAI-compatible HTTP API (FastAPI): routes, auth, body limits, errors, SSE and disconnects. A request
is converted (convert.py), submitted (generation.py), then streamed as SSE or collected; a client that goes
away, streaming or not, closes its generation (Cancel on the bus)."""

# Bodies are read and validated here, not by FastAPI's injection, so every refusal has OpenAI's error body
# and status (400, not FastAPI's 422) and the size limit is enforced while reading.

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from libs.telemetry.context import TRACEPARENT, context_from_headers, new_traceparent, request_context
from libs.tokenizer import Tokenizer
from services.gateway import formatting as fmt
from services.gateway.choice_parser import ChoiceParser, whole_message
from services.gateway.convert import ModelInfo, Plan, plan_chat, plan_completion
from services.gateway.errors import ApiError, error_body
from services.gateway.generation import Generation
from services.gateway.mesh_client import MeshClient
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import install_openapi
from services.gateway.output import TokenText
from services.gateway.readiness import Readiness
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, split_unknown
from services.gateway.settings import GatewaySettings

log = logging.getLogger("moemesh.gateway")

CLIENT_GONE = 499  # nginx's "client closed request", for metrics only
_JSON = msgspec.json.Decoder()  # request bodies: any JSON value, as json.loads gives it


@dataclass
class GatewayContext:
    """Everything the routes use; built once per process by the service."""

    settings: GatewaySettings
    tokenizer: Tokenizer
    info: ModelInfo
    mesh: MeshClient
    metrics: GatewayMetrics
    healthy: Callable[[], bool]
    started: int = 0
    readiness: Callable[[], Readiness] | None = None  # /ready's view of the mesh (readiness.py)
    tokens: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = TokenText(self.tokenizer)
        self.started = self.started or int(time.time())


# --- request parsing -------------------------------------------------------------------------


def _authorize(ctx: GatewayContext, request: Request) -> None:
    key = ctx.settings.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(
            401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
        )


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over the limit of {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body over the limit of {limit} bytes", code="body_too_large")
    try:
        data = _JSON.decode(body)  # msgspec: faster than json.loads on long id prompts; NaN is not JSON
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return data


def validation_error(e: pydantic.ValidationError | RequestValidationError) -> ApiError:
    """pydantic's errors as one 400 naming the first offending parameter."""
    errors = e.errors()
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = "unrecognized request argument" if err.get("type") == "extra_forbidden" else err.get("msg", "")
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first = errors[0].get("loc", ()) if errors else ()
    param = next((str(x) for x in first if x != "body"), None)
    return ApiError(400, "; ".join(parts) + more, param=param, code="invalid_value")


def _parse(model: type[pydantic.BaseModel], data: dict[str, Any], strict: bool = True) -> Any:
    """The request body as `model`; unless strict, unknown top-level fields are dropped with one log line."""
    if not strict:
        data, ignored = split_unknown(model, data)
        if ignored:
            log.info("ignored request fields this server does not use: %s", ", ".join(ignored))
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def _check_model(ctx: GatewayContext, name: str) -> None:
    if name != ctx.info.name:
        raise ApiError(
            404, f"The model `{name}` does not exist (this server serves `{ctx.info.name}`)",
            param="model", code="model_not_found",
        )  # fmt: skip


# --- streaming -------------------------------------------------------------------------------


class _SSEResponse(StreamingResponse):
    """An SSE stream that owns its generation: when the response ends for any reason (done, client gone,
    server shutdown, never started) the event generator and the generation close now, not at GC; a client
    disconnect cancels the stream (499)."""

    # Its own ASGI call rather than StreamingResponse's, which runs the body in a second task of an anyio
    # task group beside a disconnect listener (CPU per response), one loop turn before the headers go out,
    # and ends with an empty body message (a socket write of its own). Here the calling task sends the body
    # and the last event (`data: [DONE]`) closes the response in the same write.

    def __init__(self, events: AsyncIterator[bytes], gen: Generation, done: Callable[[int], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events, self._gen, self._done = events, gen, done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:  # the client going away while the stream waits for tokens
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        watcher.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed receive() is not ours
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = False
            async for chunk in self._events:
                last = chunk.endswith(fmt.SSE_DONE)  # a token's text is JSON-escaped: only the end has it raw
                # Before the response's last message the watcher goes: uvicorn's receive() reports a disconnect
                # once the response is complete, which must not cancel this task.
                if last:
                    watcher.cancel()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if not last:
                watcher.cancel()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:  # not the client's: the server's (shutdown)
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]
            self._gen.close("client disconnected")
            self._done(CLIENT_GONE)  # no-op when the stream already counted itself


def _so_far(gen: Generation, chunk: dict) -> dict:
    """With `stream_options.continuous_usage_stats` (vLLM's, and SGLang's), every chunk carries the
    request's usage so far: clients count the tokens of each chunk exactly without asking for logprobs."""
    if gen.plan.continuous_usage:
        chunk["usage"] = gen.usage().as_dict()
    return chunk


def _chunk(gen: Generation, chat: bool, index: int, text: str, step_lp: Any, finish: str | None) -> dict:
    usage_field = gen.plan.include_usage
    if chat:
        delta = {"content": text} if text or finish is None else {}
        return _so_far(gen, fmt.chat_chunk(
            gen.id, gen.created, gen.model, index, delta, logprobs=step_lp, finish_reason=finish,
            with_usage_field=usage_field,
        ))  # fmt: skip
    return _so_far(gen, fmt.completion_chunk(
        gen.id, gen.created, gen.model, index, text, logprobs=step_lp, finish_reason=finish,
        with_usage_field=usage_field,
    ))  # fmt: skip


async def _sse_events(gen: Generation, chat: bool, done: Callable[[int], None]) -> AsyncIterator[bytes]:
    status = CLIENT_GONE
    pending: list[bytes] = []  # events of steps already queued go out in one write: same events, fewer sends
    try:
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                for out in gen.outputs:
                    first = fmt.chat_chunk(
                        gen.id, gen.created, gen.model, out.index, role, with_usage_field=gen.plan.include_usage
                    )
                    yield fmt.sse(_so_far(gen, first))
            tools, reasoning = gen.plan.tools, gen.plan.reasoning
            parsed = chat and (tools is not None or reasoning)
            parsers = {o.index: ChoiceParser.create(reasoning, tools) for o in gen.outputs} if parsed else {}
            # the common chunk (text only: no logprobs, not the last) as precomputed bytes around the text
            frames = {} if parsers or gen.plan.logprobs or gen.plan.continuous_usage else {
                o.index: fmt.text_frame(_chunk(gen, chat, o.index, fmt.TEXT_MARK, None, None)) for o in gen.outputs
            }  # fmt: skip
            async for out, step in gen.steps():
                if step.text and step.finish_reason is None and (frame := frames.get(out.index)) is not None:
                    pending.append(frame[0] + fmt.json_str(step.text) + frame[1])
                elif out.index in parsers:
                    delta, finish = parsers[out.index].step(step.text, step.finish_reason)
                    if delta or step.logprobs or step.done:
                        pending.append(fmt.sse(_so_far(gen, fmt.chat_chunk(
                            gen.id, gen.created, gen.model, out.index, delta or {}, logprobs=step.logprobs,
                            finish_reason=finish, with_usage_field=gen.plan.include_usage,
                        ))))  # fmt: skip
                elif step.text or step.logprobs or step.done or (step.tokens and gen.plan.continuous_usage):
                    # with continuous usage, a step of tokens without text (held back, or ids past the
                    # tokenizer's vocab) still sends its chunk: the usage in it counts them (vLLM's completions)
                    pending.append(fmt.sse(_chunk(gen, chat, out.index, step.text, step.logprobs, step.finish_reason)))
                if pending and gen.queue.empty():
                    yield b"".join(pending)
                    pending.clear()
            if gen.plan.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                pending.append(fmt.sse(fmt.usage_chunk(gen.id, obj, gen.created, gen.model, gen.usage())))
            status = 200
        except ApiError as e:
            status = e.status
            log.info("request %s ended with %d mid-stream: %s", gen.id, e.status, e.message)
            pending.append(fmt.sse(e.body()))
        yield b"".join(pending) + fmt.SSE_DONE
    finally:
        gen.close("client disconnected")
        done(status)


# --- non-streaming ---------------------------------------------------------------------------


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was already read, so receive() only waits)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: Generation, request: Request) -> None:
    async def consume() -> None:
        async for _ in gen.steps():
            pass

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ApiError(CLIENT_GONE, "client disconnected")
        work.result()
    finally:
        for t in (work, watch):
            t.cancel()
        gen.close("client disconnected")


def _response(gen: Generation, chat: bool) -> dict[str, Any]:
    build = fmt.chat_response if chat else fmt.completion_response
    choices, plan = gen.choices(), gen.plan
    if chat and (plan.tools is not None or plan.reasoning):
        for k, c in enumerate(choices):
            msg = whole_message(plan.reasoning, plan.tools, c.text, c.finish_reason)
            choices[k] = dataclasses.replace(
                c, content=msg.content, tool_calls=msg.tool_calls or None, finish_reason=msg.finish_reason,
                reasoning_content=msg.reasoning_content,
            )  # fmt: skip
    return build(gen.id, gen.created, gen.model, choices, gen.usage())


# --- the generation endpoints ----------------------------------------------------------------


async def _generate(ctx: GatewayContext, request: Request, chat: bool) -> Response:
    arrival = time.monotonic()
    endpoint = "chat" if chat else "completions"
    finished = False

    def done(status: int) -> None:
        nonlocal finished
        if not finished:
            finished = True
            ctx.metrics.in_flight.dec()
            ctx.metrics.requests.labels(endpoint, str(status)).inc()

    ctx.metrics.in_flight.inc()
    gen: Generation | None = None
    handed_off = False  # once the SSE response owns the generation, it closes it
    try:
        _authorize(ctx, request)
        if ctx.mesh.in_flight >= ctx.settings.max_in_flight:  # bounded memory under overload
            raise ApiError(429, "too many requests in flight at this gateway", code="overloaded")
        data = await _read_json(request, ctx.settings.max_body_bytes)
        req = _parse(ChatCompletionRequest if chat else CompletionRequest, data, ctx.settings.strict_fields)
        _check_model(ctx, req.model)
        plan: Plan = (plan_chat if chat else plan_completion)(req, ctx.tokenizer, ctx.info)  # type: ignore[arg-type]
        gen = Generation(
            ctx.mesh, plan, ctx.tokenizer, ctx.tokens, ctx.info.name, ctx.metrics,
            arrival=arrival, deadline=arrival + ctx.settings.request_timeout_s,
            id_prefix="chatcmpl" if chat else "cmpl", max_migrations=ctx.settings.max_migrations,
        )  # fmt: skip
        traceparent, _ = context_from_headers({TRACEPARENT: request.headers.get(TRACEPARENT, "")})
        with request_context(traceparent=traceparent or new_traceparent()):
            await gen.start(ctx.settings.submit_timeout_s, ctx.settings.migration_wait_s)
        if plan.stream:
            handed_off = True
            return _SSEResponse(_sse_events(gen, chat, done), gen, done)
        await _collect(gen, request)
        done(200)
        return JSONResponse(_response(gen, chat))
    except ApiError as e:
        done(e.status)
        raise
    except asyncio.CancelledError:
        done(CLIENT_GONE)
        raise
    except Exception:
        done(500)
        raise
    finally:
        if gen is not None and not handed_off:
            gen.close("request abandoned")


# --- app -------------------------------------------------------------------------------------


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(title="moemesh gateway", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    _install_error_handlers(app)
    install_openapi(app)  # request bodies and error statuses in /openapi.json
    app.add_middleware(_GenerationRoutes, ctx=ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(ctx, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(ctx, request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _authorize(ctx, request)
        return JSONResponse(fmt.models_list([ctx.info.name], ctx.started, ctx.info.max_context))

    @app.get("/health")
    async def health() -> Response:
        ok = ctx.healthy()
        body = {"status": "ok" if ok else "unavailable", "gateway_id": ctx.mesh.gateway_id}
        return JSONResponse(body, status_code=200 if ok else 503)

    # A probe, not API: 503 is its normal "not yet" answer, so it stays out of /openapi.json.
    @app.get("/ready", include_in_schema=False)
    async def ready() -> Response:
        return _ready_response(ctx)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _ready_response(ctx: GatewayContext) -> Response:
    """200 when a request admitted now could run (readiness.py), else 503 with the reason as OpenAI's
    error body; either way the counts it was decided on."""
    r = ctx.readiness() if ctx.readiness is not None else None
    reason = "the gateway is not connected to NATS, or is draining" if not ctx.healthy() else None
    reason = reason or (r.reason if r is not None else "the gateway has no view of the mesh yet")
    body: dict[str, Any] = {"status": "ready" if reason is None else "unavailable", "model": ctx.info.name}
    if r is not None:
        body |= {"decode_workers": r.decode_workers, "prefill_workers": r.prefill_workers,
                 "schedulers": r.schedulers, "prompt_path": r.prompt_path}  # fmt: skip
    if reason is None:
        return JSONResponse(body)
    return JSONResponse(error_body(503, reason, code="not_ready") | body, status_code=503)


async def _api_error(request: Request, e: ApiError) -> Response:
    if e.status == CLIENT_GONE:
        return Response(status_code=CLIENT_GONE)
    headers = None
    if e.status in (429, 503):  # clients (and the openai library) back off this long
        headers = {"Retry-After": str(request.app.state.ctx.settings.retry_after_s)}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _invalid(_: Request, e: RequestValidationError) -> Response:
    return JSONResponse(validation_error(e).body(), status_code=400)


async def _http_error(_: Request, e: HTTPException) -> Response:
    return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)


async def _internal(_: Request, e: Exception) -> Response:
    log.exception("unhandled error")
    return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)


_ERROR_HANDLERS: list[tuple[type[Exception], Callable[[Request, Any], Any]]] = [
    (ApiError, _api_error), (RequestValidationError, _invalid), (HTTPException, _http_error),
    (Exception, _internal),
]  # fmt: skip


def _install_error_handlers(app: FastAPI) -> None:
    for exc, handler in _ERROR_HANDLERS:
        app.add_exception_handler(exc, handler)


async def _error_response(request: Request, e: Exception) -> Response:
    """What the app's exception handlers answer for e (the first of _ERROR_HANDLERS it is an instance of)."""
    return await next(h for exc, h in _ERROR_HANDLERS if isinstance(e, exc))(request, e)


_GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path: chat


class _GenerationRoutes:
    """POST to the two generation endpoints straight from the ASGI call, past Starlette's middleware, router
    and FastAPI's request handling (their cost per request), with the same handler (`_generate`) and error
    answers; the routes stay registered for /openapi.json. Anything else goes on to the app."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Any], ctx: GatewayContext) -> None:
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = None
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = _GENERATION_PATHS.get(scope["path"])
        if chat is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await _generate(self.ctx, request, chat)
        except Exception as e:
            response = await _error_response(request, e)
        await response(scope, receive, send)
