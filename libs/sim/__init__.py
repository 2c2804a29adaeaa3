"""The timing-model engine: the real Engine with its forward pass replaced by a modeled wait (engine.py),
and the step-time model fitted to the H200 decode records (step_time.py)."""

from __future__ import annotations

from typing import Any

from libs.sim.engine import SimEngine, next_token
from libs.sim.step_time import H200_DECODE, DecodeFit, StepTimeModel, fit_decode, load_records


def sim_engine(s: Any) -> SimEngine:
    """A worker's SimEngine from its WorkerSettings (engine=sim)."""
    timing = StepTimeModel(
        prefill_fixed_ms=s.sim_prefill_fixed_ms,
        prefill_per_token_ms=s.sim_prefill_ms_per_token,
        speed=s.sim_speed,
    )
    return SimEngine.from_checkpoint(
        s.model_dir, timing, page_size=s.page_size, num_pages=s.num_pages or None,
        max_num_seqs=s.max_num_seqs, max_prefill_tokens=s.max_prefill_tokens,
        enable_prefix_cache=s.enable_prefix_cache,
    )  # fmt: skip


__all__ = [
    "H200_DECODE",
    "DecodeFit",
    "SimEngine",
    "StepTimeModel",
    "fit_decode",
    "load_records",
    "next_token",
    "sim_engine",
]
