"""OpenAI response bodies and SSE framing, as plain dicts built from the gateway's own results (pure: no I/O,
no tokenizer). Field names and nesting follow OpenAI's API reference for chat.completion,
chat.completion.chunk and text_completion, so the official clients parse them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

# JSON has no -inf; a token the model rules out completely gets this (vLLM does the same).
MIN_LOGPROB = -9999.0

SSE_DONE = b"data: [DONE]\n\n"


_json = msgspec.json.Encoder()  # compact UTF-8 JSON, several times cheaper than json.dumps per event


def sse(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + _json.encode(obj) + b"\n\n"


TEXT_MARK = "\x01moemesh-text\x01"  # stands for the text while a chunk's framing is encoded
_TEXT_MARK_JSON = _json.encode(TEXT_MARK)
json_str = _json.encode  # a str as its JSON string literal


def text_frame(chunk: dict[str, Any]) -> tuple[bytes, bytes]:
    """The SSE bytes before and after the text of `chunk` (built with `TEXT_MARK` as its text), so a
    stream's text chunks are `before + json_str(text) + after`: byte for byte what `sse(chunk)` gives,
    without building and encoding the dict per token."""
    before, _, after = sse(chunk).partition(_TEXT_MARK_JSON)
    return before, after


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


@dataclass(frozen=True)
class TopEntry:
    token: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True)
class LogprobEntry:
    """Logprob of one output token as the client will see it; `offset` is the character offset of the
    token's text in the choice's output (completions' text_offset)."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[TopEntry] = field(default_factory=list)
    offset: int = 0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class Choice:
    """The finished output of one choice."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[LogprobEntry] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # chat: OpenAI tool_calls parsed from the text
    content: str | None = None  # chat with tool calls or reasoning: the answer (None: none written)
    reasoning_content: str | None = None  # chat with a reasoning parser: the text before </think>


# --- logprobs ----------------------------------------------------------------------------------


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    """`choices[].logprobs` of the chat API: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _lp(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": _lp(t.logprob), "bytes": t.bytes} for t in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    """`choices[].logprobs` of the legacy completions API (parallel lists; top as {token: logprob})."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": [{t.token: _lp(t.logprob) for t in e.top} for e in entries],
        "text_offset": [e.offset for e in entries],
    }


# --- chat --------------------------------------------------------------------------------------


def _head(rid: str, obj: str, created: int, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    *,
    logprobs: Sequence[LogprobEntry] | None = None,
    finish_reason: str | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """One chat.completion.chunk for one choice. With include_usage every chunk carries `usage: null`."""
    out = _head(rid, "chat.completion.chunk", created, model)
    out["choices"] = [
        {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": finish_reason,
        }
    ]
    if with_usage_field:
        out["usage"] = None
    return out


def usage_chunk(rid: str, obj: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with include_usage: empty choices, the request's usage."""
    out = _head(rid, obj, created, model)
    out["choices"] = []
    out["usage"] = usage.as_dict()
    return out


def chat_response(
    rid: str, created: int, model: str, choices: Sequence[Choice], usage: Usage
) -> dict[str, Any]:
    out = _head(rid, "chat.completion", created, model)
    out["choices"] = [
        {
            "index": c.index,
            "message": _message(c),
            "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    out["usage"] = usage.as_dict()
    return out


def _message(c: Choice) -> dict[str, Any]:
    parsed = c.tool_calls or c.reasoning_content is not None
    msg = {"role": "assistant", "content": c.content if parsed else c.text, "refusal": None,
           "tool_calls": c.tool_calls or []}  # fmt: skip
    if c.reasoning_content is not None:  # only with a reasoning parser, as vLLM's
        msg["reasoning_content"] = c.reasoning_content
    return msg


# --- completions -------------------------------------------------------------------------------


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    *,
    logprobs: Sequence[LogprobEntry] | None = None,
    finish_reason: str | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    out = _head(rid, "text_completion", created, model)
    out["choices"] = [
        {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": finish_reason,
        }
    ]
    if with_usage_field:
        out["usage"] = None
    return out


def completion_response(
    rid: str, created: int, model: str, choices: Sequence[Choice], usage: Usage
) -> dict[str, Any]:
    out = _head(rid, "text_completion", created, model)
    out["choices"] = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": completion_logprobs(c.logprobs) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    out["usage"] = usage.as_dict()
    return out


def models_list(names: Sequence[str], created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "moemesh",
                "max_model_len": max_model_len,
            }
            for n in names
        ],
    }
