"""OpenAI request bodies as pydantic models (the HTTP edge only; converted to proto at once). Range checks on
the fields name the parameter; unknown top-level fields are ignored with a log line (`strict_fields`: refused);
unimplemented output-changing fields (`OUTPUT_CHANGING`) and values (`check_unsupported`) are refused."""

# Unknown fields are ignored by default as vLLM does: clients built on the OpenAI SDK send `store`,
# `metadata`, `service_tier`, ... by default.

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from services.gateway.errors import ApiError, unsupported

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
# Not implemented, and ignoring them would silently change what the client gets: 400 even when lenient.
OUTPUT_CHANGING = frozenset(
    {"functions", "function_call", "prediction", "audio", "modalities", "web_search_options", "logits_processors"}
)


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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    """Fields shared by chat and completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=2**63)] | None = None  # the bus carries int64: larger is a 400
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**63)]] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extension: logprobs name each token "token_id:<id>" (exact, where its text may not be)
    return_tokens_as_token_ids: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras (either spelling)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

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
    # vLLM's: extra variables for the chat template (DeepSeek-V3.1: {"thinking": true})
    chat_template_kwargs: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        self.check_common()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def plain_token_ids(value: object) -> bool:
    """Whether `value` is a non-empty list of plain ints (no bools), none negative, checked at C speed."""
    return type(value) is list and bool(value) and set(map(type, value)) == {int} and min(value) >= 0


def _token_ids_fast(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A prompt of token ids taken at C speed (pydantic's smart union validates such a list id by id through
    its members). Anything else goes through the union, so values, coercions and errors are pydantic's; the
    JSON schema is the union's."""
    if plain_token_ids(value):
        return value
    if type(value) is list and value and all(plain_token_ids(p) for p in value):
        return value
    return handler(value)


PromptUnion = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
Prompt = Annotated[PromptUnion, WrapValidator(_token_ids_fast)]


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
        if isinstance(p[0], int):  # the union admits no mixed list: one int means a list of ids
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def split_unknown(model: type[BaseModel], data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(data without the top-level keys `model` does not know, those keys sorted); ApiError 400 for a key
    in OUTPUT_CHANGING."""
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(k for k in data if k not in known)
    refused = next((k for k in unknown if k in OUTPUT_CHANGING), None)
    if refused is not None:
        raise unsupported(refused, f"`{refused}`")
    return {k: v for k, v in data.items() if k in known}, unknown
