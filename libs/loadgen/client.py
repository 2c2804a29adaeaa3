"""One streamed request against an OpenAI-compatible server, timed chunk by chunk."""

# Backends: `openai` posts to `/v1/completions` (prompt as text or token ids), `openai-chat` to
# `/v1/chat/completions` (one user message of text). Every request streams with
# `stream_options.include_usage`, so the token counts come from the server's usage, and sets
# `ignore_eos: true` so each output runs to its max_tokens (vLLM and SGLang accept the field; a strict
# OpenAI server may not, which `extra_body` cannot remove: use it against servers that do).
#
# Parsing (`parse_chunk`) is pure; `send` does the I/O and never raises for a failed request: the
# failure is recorded in the RequestRecord (HTTP status, error event, broken stream).

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from libs.loadgen.datasets import BenchRequest
from libs.loadgen.stats import RequestRecord

BACKENDS = ("openai", "openai-chat")


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: base URL (without /v1), backend, model, key, extra body fields. `chunk_usage`
    (`stream_options.continuous_usage_stats`) or `chunk_logprobs` make each chunk's token count exact; the
    first costs the model nothing, the second has the server compute logprobs."""

    base_url: str
    backend: str = "openai"
    model: str = ""
    api_key: str = ""
    extra_body: dict[str, Any] = field(default_factory=dict)
    chunk_logprobs: bool = False
    chunk_usage: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")

    @property
    def chat(self) -> bool:
        return self.backend == "openai-chat"

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(ep: Endpoint, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": ep.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, **({"continuous_usage_stats": True} if ep.chunk_usage else {})},
        "ignore_eos": True,
    }
    if ep.chat:
        if not isinstance(req.prompt, str):
            raise ValueError("the openai-chat backend sends text prompts (datasets.to_text converts ids)")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if ep.chunk_logprobs:
            body["logprobs"] = True
    else:
        body["prompt"] = req.prompt
        if ep.chunk_logprobs:
            body["logprobs"] = 0
    body.update(ep.extra_body)
    return body


@dataclass(frozen=True)
class Chunk:
    """What one SSE event means for timing: tokens it carried (0: no content), usage, error; `so_far`:
    the completion tokens streamed up to and including this chunk, where the server says (continuous
    usage stats on a chunk with choices)."""

    tokens: int = 0
    usage: dict[str, Any] | None = None
    error: str = ""
    so_far: int | None = None


def _logprob_tokens(choice: dict[str, Any], chat: bool) -> int | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    items = lp.get("content") if chat else lp.get("tokens")
    return len(items) if isinstance(items, list) else None


def parse_chunk(data: dict[str, Any], chat: bool) -> Chunk:
    """One decoded `data:` event. Content tokens: the logprob entries when present, else 1 for a
    chunk with text (a role-only or finish-only chunk carries none). A chunk with choices and usage
    (continuous usage stats) also reports the server's count so far (`record_chunk` prefers it)."""
    if "error" in data:
        err = data["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    tokens = 0
    for choice in data.get("choices") or []:
        named = _logprob_tokens(choice, chat)
        if named is not None:
            tokens += named
            continue
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        tokens += 1 if text else 0
    so_far = usage.get("completion_tokens") if usage is not None and data.get("choices") else None
    return Chunk(tokens=tokens, usage=usage, so_far=so_far if isinstance(so_far, int) else None)


def record_chunk(rec: RequestRecord, chunk: Chunk, now: float) -> None:
    """One event into the record: its error, and its tokens at `now` (the server's count since the last
    chunk where it gives one, which also counts tokens whose text an earlier chunk held back)."""
    if chunk.error:
        rec.error = chunk.error
    tokens = chunk.tokens
    if chunk.so_far is not None:
        tokens = chunk.so_far - rec.completion_tokens  # completion_tokens: the running count until the end
        rec.completion_tokens = chunk.so_far
    if tokens > 0:
        rec.chunk_times.append(now)
        rec.chunk_tokens.append(tokens)


def finish_record(rec: RequestRecord, usage: dict[str, Any] | None, now: float) -> None:
    rec.end = now
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    else:
        rec.completion_tokens = sum(rec.chunk_tokens)
    if not rec.chunk_times:
        rec.error = rec.error or "the stream carried no tokens"
    rec.ok = not rec.error


async def send(
    client: httpx.AsyncClient, ep: Endpoint, req: BenchRequest, index: int, clock: Callable[[], float]
) -> RequestRecord:
    """Stream one request; every chunk's arrival is stamped with `clock()` (seconds, monotonic)."""
    body = request_body(ep, req)
    rec = RequestRecord(index=index, start=clock(), prompt_tokens=req.input_len)
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", ep.url, json=body, headers=ep.headers()) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text[:500]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = parse_chunk(json.loads(payload), ep.chat)
                    record_chunk(rec, chunk, clock())
                    usage = chunk.usage or usage
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finish_record(rec, usage, clock())
    return rec


def run_clock(t0: float | None = None) -> Callable[[], float]:
    """A clock of seconds since t0 (now by default) on time.monotonic: CLOCK_MONOTONIC on Linux, one
    clock for every process of the machine, so client processes' records line up with the parent's."""
    base = time.monotonic() if t0 is None else t0
    return lambda: time.monotonic() - base


class StreamClient(Protocol):
    """What the load loop sends through: `send` streams one request into a RequestRecord (never raising
    for a failed request); `aclose` ends the connections. Kinds: `HttpxClient`, `raw_client.RawClient`."""

    async def send(
        self, ep: Endpoint, req: BenchRequest, index: int, clock: Callable[[], float]
    ) -> RequestRecord: ...

    async def aclose(self) -> None: ...


class HttpxClient:
    """`send` over one pooled httpx client: https://, HTTP/1.1 or anything the raw client does not speak.
    No read timeout (a slowed server may pause for long); a connect timeout so a wrong URL fails fast."""

    def __init__(self, connections: int) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits)

    async def send(
        self, ep: Endpoint, req: BenchRequest, index: int, clock: Callable[[], float]
    ) -> RequestRecord:
        return await send(self.client, ep, req, index, clock)

    async def aclose(self) -> None:
        await self.client.aclose()


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str = "") -> str:
    """The first model id the server lists at /v1/models (bench_serving's default --model)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    if resp.status_code != 200:
        raise ValueError(f"GET /v1/models answered {resp.status_code}: {resp.text[:300]}")
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url} lists no model at /v1/models; pass --model")
    return str(data[0]["id"])
