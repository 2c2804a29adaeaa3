"""Per-request state inside the engine: tokens are `prompt_ids + output_ids`, of which the first `num_computed`
have KV rows in `pages`; a decoding request has num_computed == num_tokens - 1 (its newest token is fed next
step). A preempted request keeps its outputs and recomputes prompt + outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from libs.engine.radix_cache import RadixNode
from libs.engine.sampling import SamplingParams, TokenLogprob
from libs.engine.stopping import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at (first) admission
    num_cached_pages: int = 0  # pages[:num_cached_pages] are shared from the prefix cache
    admitted: bool = False
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cache_node: RadixNode | None = None  # locked radix node backing pages[:num_cached_pages]
    stopper: StopChecker | None = None
    pin_after_prefill: bool = False  # PD prefill (Engine.add_prefill): pinned, not decoded, after the prompt
    # PD: the prefill side's block hashes of the prompt (Engine.add_prefilled), reused when it is cached
    prompt_hashes: list[int] = field(default_factory=list)
    seed: int = 0  # Philox key of the one-pass sampler (libs.kernels.gumbel): params.seed or a random one

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """tokens[start:start + n] without building the whole list (a decode step reads one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : start - p + n]
        return (self.prompt_ids[start : start + n] + self.output_ids[: max(0, start + n - p)])[:n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_decode(self) -> bool:
        """Prompt done: the next forward feeds exactly the newest output token."""
        return self.num_computed == self.num_tokens - 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
