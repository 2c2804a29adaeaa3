"""The timing-model engine: the real Engine with its forward pass replaced by a modeled wait (engine.py),
and the step-time model fitted to the H200 decode records (step_time.py)."""

from __future__ import annotations

from typing import Any

from libs.engine.args import EngineArgs
from libs.sim.engine import SimEngine, next_token
from libs.sim.step_time import H200_DECODE, DecodeFit, StepTimeModel, fit_decode, load_records


def sim_engine(s: Any, args: EngineArgs) -> SimEngine:
    """A worker's SimEngine (engine=sim): its step-time model from the WorkerSettings `s`, its args."""
    timing = StepTimeModel(
        prefill_fixed_ms=s.sim_prefill_fixed_ms,
        prefill_per_token_ms=s.sim_prefill_ms_per_token,
        speed=s.sim_speed,
    )
    return SimEngine.from_checkpoint(s.model_dir, timing, args)


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
