"""OpenAI request bodies as pydantic models (the HTTP edge only; converted to proto at once).

Range checks live on the fields, so a bad value is a validation error whose location names the
parameter. Unknown fields are refused (as OpenAI does) rather than silently ignored: a client that sends
a parameter this server does not implement learns so instead of getting different behaviour. Parameters
that exist in OpenAI's API but that the mesh cannot honour (penalties, tools, structured output, ...)
are accepted at their neutral value and refused otherwise, by `check_unsupported`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.errors import ApiError, unsupported

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; content as a string or a list of text parts. Extra keys (e.g. `name`) are kept so
    the chat template can see them."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class _Sampling(_Strict):
    """Fields shared by chat and completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extension: logprobs name each token "token_id:<id>" (exact, where its text may not be)
    return_tokens_as_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_common(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise unsupported(name, "a non-zero penalty")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def check_unsupported(self) -> None:
        self.check_common()
        if self.tools:
            raise unsupported("tools", "tool calling")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool calling")
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported("response_format", f"response_format type {self.response_format.type!r}")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        self.check_common()
        if self.echo:
            raise unsupported("echo", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of other than n")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list: each a text or a list of token ids (one choice set per prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
