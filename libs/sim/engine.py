"""The timing-model engine ("mocker"): the real Engine (admission, batching, paging, prefix cache and its
events, PD reserve/add_prefilled, stop checks) with each forward replaced by a wait from a StepTimeModel
and its logits by deterministic tokens (a hash of previous token and position, never an end id)."""

# The engine thread sleeps the modeled time, holding it for the step as a GPU worker's forward does. The KV
# pool is one layer of one byte per token: page geometry, handles and transfer plans are real; the bytes a
# transfer moves are 1/(layers * row bytes) of the real model's.

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from libs.engine.args import EngineArgs, with_overrides
from libs.engine.config import ModelConfig
from libs.engine.engine import Engine
from libs.engine.runner import Chunk
from libs.engine.sampling import SampleOutput, TokenLogprob
from libs.sim.step_time import StepTimeModel
from libs.tokenizer import Tokenizer

_MASK = (1 << 64) - 1


def next_token(prev: int, position: int, vocab_size: int, avoid: Sequence[int] = ()) -> int:
    """The token after `prev` at `position` (splitmix64 of both): deterministic, spread over the vocab."""
    z = (prev * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    tok = (z ^ (z >> 31)) % vocab_size
    while tok in avoid:
        tok = (tok + 1) % vocab_size
    return int(tok)


class SimRunner:
    """Stands in for ModelRunner: waits the modeled forward time, returns next-token ids [S', 1]."""

    def __init__(self, timing: StepTimeModel, vocab_size: int, avoid: Sequence[int]) -> None:
        self.timing, self.vocab_size, self.avoid = timing, vocab_size, tuple(avoid)
        self.forwards = 0
        self.modeled_s = 0.0  # total modeled forward time (what the engine thread slept)

    def forward_last(self, chunks: Sequence[Chunk], want: Sequence[bool] | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        if not chunks or any(not c.tokens for c in chunks):
            raise ValueError("a forward needs at least one chunk, each with at least one token")
        ends = [c.start + len(c.tokens) for c in chunks]
        keep = [True] * len(chunks) if want is None else list(want)
        out = [
            next_token(c.tokens[-1], end, self.vocab_size, self.avoid)
            for c, end, w in zip(chunks, ends, keep, strict=True)
            if w
        ]
        seconds = self.timing.forward_ms([len(c.tokens) for c in chunks], ends) / 1000
        self.forwards += 1
        self.modeled_s += seconds
        left = seconds - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return torch.tensor(out, dtype=torch.int64).unsqueeze(1)

    def forward_all(self, chunk: Chunk) -> torch.Tensor:
        raise NotImplementedError("the timing-model engine has no logits (prefill_logits)")


class _PoolOnly:
    """What Engine.__init__ reads from a model: a config (pool geometry scaled down), dtype, device."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.dtype = torch.uint8
        self.device = torch.device("cpu")

    def attention_backend(self, name: str, kv_cache_dtype: str = "auto") -> None:
        return None


class SimEngine(Engine):
    def __init__(
        self, config: ModelConfig, timing: StepTimeModel | None = None, args: EngineArgs | None = None, *,
        tokenizer: Tokenizer | None = None, **overrides: Any,
    ) -> None:  # fmt: skip
        """`args` and overrides as Engine takes them; there are no decode graphs to capture."""
        # the pool is a scaled-down stand-in: its rows hold no values, in any kv_cache_dtype
        a = msgspec.structs.replace(with_overrides(args, overrides), cuda_graphs=False, kv_cache_dtype="auto")
        pool_cfg = dataclasses.replace(config, num_hidden_layers=1, kv_lora_rank=1, qk_rope_head_dim=0)
        super().__init__(_PoolOnly(pool_cfg), a, tokenizer=tokenizer)  # type: ignore[arg-type]
        self.config = config  # the served model's vocab, context and end ids; only the pool is scaled down
        self.timing = timing or StepTimeModel()
        self.runner = SimRunner(self.timing, config.vocab_size, self.eos_ids)  # type: ignore[assignment]

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        timing: StepTimeModel | None = None,
        args: EngineArgs | None = None,
        **overrides: Any,
    ) -> SimEngine:
        """A checkpoint folder's config.json and tokenizer; its weights are never read."""
        tok = Tokenizer.from_pretrained(path) if (Path(path) / "tokenizer.json").exists() else None
        return cls(ModelConfig.from_pretrained(path), timing, args, tokenizer=tok, **overrides)

    def _sample(self, logits: torch.Tensor, reqs: list) -> SampleOutput:
        params = [r.params for r in reqs]
        tokens = logits[:, 0].tolist()
        lps = [TokenLogprob(t, 0.0, ((t, 0.0),)[: p.num_top_logprobs]) if p.wants_logprobs else None
               for t, p in zip(tokens, params, strict=True)]  # fmt: skip
        return SampleOutput(tokens, lps)
