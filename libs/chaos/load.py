"""Streaming load for fault tests: many greedy completions through the gateway, each bounded by a
client-side deadline (a request that outlives it is recorded as hung, never waited on forever), with a
progress count so a fault can be injected while the streams run."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    """One streamed request: its text and token ids, token count, how it ended and how long it took."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # from logprobs with return_tokens_as_token_ids
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # the error event's message (or the HTTP status) when it failed cleanly
    hung: bool = False  # still running at the client deadline
    seconds: float = 0.0
    chunks: int = 0
    first_token_s: float | None = None  # request to first text chunk
    error_type: str | None = None  # the error's OpenAI `type`, or the transport exception's class name
    cancelled: bool = False  # the client closed the stream on purpose (cancel_after)
    request_id: str = ""  # the completion's id (the gateway's request id)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.hung and self.finish_reason is not None

    @property
    def retryable(self) -> bool:
        """An error a client should retry: 429, 503 or 504 (by OpenAI type), or the connection failing."""
        return self.error_type in RETRYABLE_TYPES or self.error_type in TRANSPORT_ERRORS


RETRYABLE_TYPES = frozenset({"rate_limit_error", "service_unavailable_error", "timeout_error"})
TRANSPORT_ERRORS = frozenset({"ConnectError", "ReadError", "RemoteProtocolError", "WriteError"})


@dataclass
class Progress:
    """Text chunks received so far, per request (to trigger a fault mid-stream)."""

    chunks: list[int] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: set[int] = field(default_factory=set)  # requests whose stream ended (finished or failed)

    def finished(self) -> int:
        return len(self.ended)

    def reached(self, min_chunks: int) -> int:
        return sum(c >= min_chunks for c in self.chunks)

    async def wait(self, requests: int, min_chunks: int, timeout: float) -> bool:
        """Until `requests` requests streamed `min_chunks` chunks each (False on timeout)."""
        deadline = time.monotonic() + timeout
        while self.reached(min_chunks) < requests:
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return False
        return True


async def stream_completion(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, deadline_s: float,
    index: int = 0, progress: Progress | None = None, cancel_after: int = 0,
) -> Outcome:  # fmt: skip
    """One greedy streaming completion (token-id prompt, ignore_eos); never raises. Every token is named by
    its id (logprobs 0, return_tokens_as_token_ids), so a chunk comes per token even where a token has no
    text (a preset checkpoint's vocabulary runs past its tiny tokenizer's) and outputs compare by id."""
    out = Outcome(index)
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}, "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }  # fmt: skip
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    out.error, out.error_type = f"HTTP {r.status_code}: {text[:200]}", _error_type(text)
                    return out
                async for line in r.aiter_lines():
                    _take(out, line, progress, t0)
                    if cancel_after and out.chunks >= cancel_after and out.finish_reason is None:
                        out.cancelled = True  # leaving the block closes the stream: the gateway cancels
                        break
    except TimeoutError:
        out.hung = True
    except httpx.HTTPError as e:
        out.error, out.error_type = f"{type(e).__name__}: {e}", type(e).__name__
    finally:
        out.seconds = time.monotonic() - t0
        if progress is not None:
            progress.ended.add(index)
    if out.error is None and not out.hung and not out.cancelled and out.finish_reason is None:
        out.error = "the stream ended without a finish reason"
    return out


def _error_type(body: str) -> str | None:
    try:
        return json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def _take(out: Outcome, line: str, progress: Progress | None, t0: float = 0.0) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    obj = json.loads(line[len("data: ") :])
    if "error" in obj:
        out.error, out.error_type = str(obj["error"].get("message")), obj["error"].get("type")
        return
    out.request_id = out.request_id or obj.get("id", "")
    if out.first_token_s is None and obj.get("choices"):
        out.first_token_s = time.monotonic() - t0
    if obj.get("usage"):
        out.completion_tokens = obj["usage"]["completion_tokens"]
    for choice in obj.get("choices", []):
        out.text += choice.get("text") or ""
        named = (choice.get("logprobs") or {}).get("tokens") or []
        out.token_ids += [int(t.removeprefix("token_id:")) for t in named]
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        out.chunks += 1
        if progress is not None:
            progress.chunks[out.index] = out.chunks
            progress.changed.set()


async def stream_many(
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    *,
    deadline_s: float = 60.0,
    fault: Callable[[Progress], Awaitable[object]] | None = None,
) -> list[Outcome]:
    """All prompts at once; `fault(progress)` runs alongside (it waits on progress, then strikes).
    Returns the outcomes in prompt order."""
    progress = Progress([0] * len(prompts))
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(deadline_s), limits=limits) as client:
        tasks = [
            asyncio.create_task(stream_completion(client, model, p, max_tokens, deadline_s, i, progress))
            for i, p in enumerate(prompts)
        ]
        if fault is not None:
            await fault(progress)
        outcomes = await asyncio.gather(*tasks)
    return list(outcomes)
