"""Input checks at the engine's edge: every bad prompt or token is a ValueError naming the problem,
raised before anything is queued or allocated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.engine.batcher import pages_for
from libs.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int  # max_position_embeddings
    page_size: int
    num_pages: int


def check_token(token: object, limits: Limits, what: str) -> int:
    if isinstance(token, torch.Tensor) and token.numel() == 1:
        token = token.item()
    vocab = limits.vocab_size
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise ValueError(f"{what}: token id {token!r} is outside the vocabulary (0..{vocab - 1})")
    return token


def _plain_ids(prompt_ids: object, vocab: int) -> list[int] | None:
    """A copy of `prompt_ids` when it is a list of plain ints (no bools, no tensors) all in 0..vocab-1,
    checked at C speed; None otherwise (check_token then says what is wrong)."""
    if type(prompt_ids) is not list or not prompt_ids:
        return None
    if set(map(type, prompt_ids)) != {int} or min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        return None
    return list(prompt_ids)


def check_prompt(prompt_ids: object, params: SamplingParams | None, limits: Limits, what: str) -> list[int]:
    """The prompt as a list of ints, or ValueError: empty, not token ids, out of vocab, too long for the
    context (prompt + max_tokens) or for the whole KV pool."""
    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(f"{what}: params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Sequence | torch.Tensor):
        raise ValueError(f"{what}: prompt must be a list of token ids, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError(f"{what}: prompt is empty")
    ids = _plain_ids(prompt_ids, limits.vocab_size)  # a decoded message's list: no call per token
    if ids is None:
        ids = [check_token(t, limits, what) for t in prompt_ids]
    max_tokens = params.max_tokens if params is not None else 0
    total = len(ids) + max_tokens
    if total > limits.context_len:
        raise ValueError(
            f"{what}: prompt of {len(ids)} tokens"
            + (f" + max_tokens {max_tokens}" if params is not None else "")
            + f" exceeds the model's context length of {limits.context_len} tokens"
        )
    need = pages_for(total, limits.page_size)
    if need > limits.num_pages:
        raise ValueError(f"{what}: {total} tokens need {need} KV pages, the pool has only {limits.num_pages}")
    return ids
