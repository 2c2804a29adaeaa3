"""What the engine hands back: per step (incremental API), per finished request (generate), per PD prefill."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.engine.sampling import TokenLogprob


@dataclass
class StepOutput:
    """One request's news from one `Engine.step()`: token_ids produced this step (empty when a request ends
    without a new one, e.g. a PD request finished by its first token); stop_reason, the stop token id or stop
    string that ended it (the caller cuts text at a stop string itself)."""

    rid: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill: PrefillResult | None = None  # a PD prefill (Engine.add_prefill) whose prompt is done, pinned


@dataclass
class GenerationOutput:
    """A finished request from `Engine.generate`."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # when the checkpoint folder has a tokenizer; cut before a stop string
    cached_tokens: int = 0


@dataclass
class PrefillResult:
    """PD prefill side: the first token and where the prompt's KV rows are (pinned until release)."""

    first_token: int
    logprobs: TokenLogprob | None
    page_ids: list[int]  # covers the whole prompt, in order; the last page may be partly filled
    cached_tokens: int
    # the block hashes of the prompt's whole pages, as this engine's prefix cache names them for KV events
    # (empty when nothing listens); the decode side reuses them when it caches the prompt
    block_hashes: list[int] = field(default_factory=list)
