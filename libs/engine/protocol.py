"""`EngineLike`: what a worker holds, satisfied by `libs.engine.Engine` and `libs.ep.engine.EPEngine` alike
(mypy checks it where the worker loads one). Called from one thread (libs.worker.engine_thread), except
`stats()`, which the heartbeat reads from the event loop."""

# PD hooks: the prefill side calls `prefill` (or add_prefill + step) then `release`; the decode side
# `reserve` / `reserve_cached`, then `add_prefilled` or `cancel_reservation`.

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from libs.engine.config import ModelConfig
from libs.engine.kv_pool import KVPool
from libs.engine.outputs import GenerationOutput, PrefillResult, StepOutput
from libs.engine.radix_cache import CacheListener
from libs.engine.sampling import SamplingParams


class EngineLike(Protocol):
    @property
    def config(self) -> ModelConfig: ...

    @property
    def page_size(self) -> int: ...

    @property
    def kv_pool(self) -> KVPool: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationOutput]: ...

    # --- incremental API (continuous batching) ---
    def add_request(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None: ...

    def step(self) -> list[StepOutput]: ...

    def abort(self, rid: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict[str, int]: ...

    # --- prefix cache ---
    def set_cache_listener(self, listener: CacheListener | None) -> None: ...

    def flush_prefix_cache(self) -> int: ...

    # --- PD hooks ---
    def prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> PrefillResult: ...

    def add_prefill(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None: ...

    def prefill_progress(self, rid: str) -> list[int]: ...

    @property
    def stalled(self) -> bool: ...

    def release(self, rid: str) -> bool: ...

    def reserve(self, rid: str, num_tokens: int) -> list[int]: ...

    def reserve_cached(self, rid: str, prompt_ids: Sequence[int]) -> tuple[int, list[int]]: ...

    def cancel_reservation(self, rid: str) -> bool: ...

    def add_prefilled(
        self, rid: str, prompt_ids: Sequence[int], first_token: int, params: SamplingParams,
        block_hashes: Sequence[int] = (),
    ) -> None: ...  # fmt: skip
