"""OpenAI request -> what the mesh runs: prompt token ids and one `proto.messages.Sampling` per choice."""

# Pure code (the tokenizer is a CPU-only library, no I/O): every check that needs the prompt's length
# (context limit, token-id range, empty prompt) happens here, before anything is sent on the bus.
# Choice `i` of prompt `p` gets index `p * n + i` (OpenAI's layout for completions with several prompts)
# and, when the request has a seed, seed + i, so n samples of one request differ but are reproducible.

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs.tokenizer import Tokenizer
from proto.messages import Guided, Sampling
from services.gateway.errors import ApiError, bad_param
from services.gateway.guided import guided_of, logit_bias_of
from services.gateway.reasoning import THINK_END, starts_in_reasoning
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.tools import ToolPlan, tool_plan

# OpenAI's default for the legacy completions API; chat defaults to "the rest of the context".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# what the gateway passes the chat template itself: chat_template_kwargs may not set them
_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway needs to know of the checkpoint, read from config.json without torch."""

    name: str
    max_context: int
    vocab_size: int
    reasoning_parser: str | None = None  # services.gateway.reasoning's parser for chat output, if any

    @classmethod
    def from_dir(cls, model_dir: str | Path, name: str, reasoning_parser: str | None = None) -> ModelInfo:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the model config {path}: {e}") from e
        missing = [k for k in ("max_position_embeddings", "vocab_size") if not isinstance(cfg.get(k), int)]
        if missing:
            raise ValueError(f"{path} lacks integer field(s) {', '.join(missing)}")
        return cls(
            name=name, max_context=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
            reasoning_parser=reasoning_parser,
        )  # fmt: skip


@dataclass(frozen=True)
class ChoicePlan:
    index: int
    prompt_index: int
    sampling: Sampling


@dataclass(frozen=True)
class Plan:
    """Everything the request needs from here on; `prompts[c.prompt_index]` is choice c's prompt."""

    prompts: list[list[int]]
    choices: list[ChoicePlan]
    stop: list[str]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage in every chunk
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (return_tokens_as_token_ids)
    tools: ToolPlan | None = None  # chat with tools: how to render them and read calls out of the output
    reasoning: bool = False  # chat: the output starts inside the reasoning (split off as reasoning_content)


def _continuous_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    o = req.stream_options
    return bool(req.stream and o and o.include_usage and o.continuous_usage_stats)


def _max_tokens(
    requested: int | None, default: int | None, prompt_len: int, info: ModelInfo, param: str
) -> int:
    room = info.max_context - prompt_len
    if requested is None:
        requested = room if default is None else min(default, room)
        if requested >= 1:
            return requested
        requested = 1  # the prompt alone fills the context: report it as the error below
    if prompt_len + requested > info.max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {info.max_context} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {param}, {requested} in the completion). "
            f"Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _check_ids(ids: Sequence[int], info: ModelInfo, param: str) -> None:
    if not ids:
        raise bad_param(param, "the prompt is empty")
    if min(ids) >= 0 and max(ids) < info.vocab_size:  # at C speed; the loop below only names the bad id
        return
    bad = next((i for i in ids if not 0 <= i < info.vocab_size), None)
    if bad is not None:
        raise bad_param(param, f"token id {bad} is out of range for a vocabulary of {info.vocab_size}")


@dataclass(frozen=True)
class Constraints:
    """What shapes the output beyond temperature and friends, computed once per request."""

    logit_bias: dict[int, float]
    guided: Guided | None


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    i: int,
    lp: tuple[bool, int],
    c: Constraints,
):
    seed = None if req.seed is None else (req.seed + i) % 2**63
    if req.min_tokens > max_tokens:
        raise bad_param("min_tokens", f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})")
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if not req.top_k else req.top_k,
        min_p=req.min_p or 0.0,
        seed=seed,
        stop_token_ids=list(req.stop_token_ids or []),
        stop=req.stop_list(),
        ignore_eos=req.ignore_eos,
        logprobs=lp[0],
        top_logprobs=lp[1],
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=c.logit_bias,
        min_tokens=req.min_tokens,
        guided=c.guided,
    )


def _plan(
    req: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    requested: int | None,
    default: int | None,
    lp: tuple[bool, int],
    info: ModelInfo,
    param: str,
    tools: ToolPlan | None = None,
    reasoning_end: list[int] | None = None,
) -> Plan:
    """reasoning_end: the ids that end the reasoning, when the output starts inside it: a constraint
    (structured output, a forced tool call) applies after them."""
    guided = guided_of(req, tools.guided() if tools else None)
    if guided is not None and reasoning_end:
        guided = msgspec.structs.replace(guided, start_after=reasoning_end)
    c = Constraints(logit_bias_of(req, info.vocab_size), guided)
    choices = []
    for p, ids in enumerate(prompts):
        _check_ids(ids, info, param)
        max_tokens = _max_tokens(requested, default, len(ids), info, param)
        for i in range(req.n):
            choices.append(ChoicePlan(p * req.n + i, p, _sampling(req, max_tokens, i, lp, c)))
    return Plan(
        prompts=prompts,
        choices=choices,
        stop=req.stop_list(),
        logprobs=lp[0],
        top_logprobs=lp[1],
        stream=req.stream,
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        continuous_usage=_continuous_usage(req),
        tokens_as_ids=req.return_tokens_as_token_ids,
        tools=tools,
        reasoning=bool(reasoning_end),
    )


def plan_chat(req: ChatCompletionRequest, tok: Tokenizer, info: ModelInfo) -> Plan:
    """Render the conversation with the checkpoint's chat template (and the request's chat_template_kwargs,
    e.g. V3.1's `thinking`) and tokenize it."""
    req.check_unsupported()
    tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    taken = sorted(set(kwargs) & _TEMPLATE_ARGS)
    if taken:
        raise bad_param("chat_template_kwargs", f"may not set {', '.join(taken)} (the request's own fields)")
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools.render if tools else None, **kwargs
        )
    except ValueError as e:
        raise bad_param("messages", f"cannot apply the chat template: {e}") from e
    ids = tok.encode(text, add_special_tokens=False)
    end = None
    if info.reasoning_parser is not None and starts_in_reasoning(text):
        end = tok.encode(THINK_END, add_special_tokens=False)
    lp = (req.logprobs, req.top_logprobs or 0)
    return _plan(req, [ids], req.requested_max_tokens(), None, lp, info, "messages", tools, end)


def _tokenize(tok: Tokenizer, prompt: str | list[int]) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    return tok.encode(prompt) if prompt else []  # "" stays empty (refused), not a lone BOS


def plan_completion(req: CompletionRequest, tok: Tokenizer, info: ModelInfo) -> Plan:
    """Text prompts are tokenized (with the BOS the tokenizer asks for); token-id prompts go as they are."""
    req.check_unsupported()
    prompts = [_tokenize(tok, p) for p in req.prompt_list()]
    lp = (req.logprobs is not None, req.logprobs or 0)
    return _plan(req, prompts, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, lp, info, "prompt")
