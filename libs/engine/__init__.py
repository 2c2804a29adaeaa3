"""The DeepSeek-V3 engine: model, paged latent KV cache, radix prefix cache, continuous batching, sampling.
`from libs.engine import Engine, EngineArgs, SamplingParams` (engine.py: the offline and incremental APIs).
Names load on first use, so importing `libs.engine.args` (worker settings) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libs.engine.args import EngineArgs
    from libs.engine.config import ModelConfig
    from libs.engine.engine import Engine
    from libs.engine.loader import load_model
    from libs.engine.outputs import GenerationOutput, PrefillResult, StepOutput
    from libs.engine.sampling import SamplingParams, TokenLogprob

_HOME = {
    "Engine": "libs.engine.engine",
    "EngineArgs": "libs.engine.args",
    "GenerationOutput": "libs.engine.outputs",
    "ModelConfig": "libs.engine.config",
    "PrefillResult": "libs.engine.outputs",
    "SamplingParams": "libs.engine.sampling",
    "StepOutput": "libs.engine.outputs",
    "TokenLogprob": "libs.engine.sampling",
    "load_model": "libs.engine.loader",
}

__all__ = [
    "Engine",
    "EngineArgs",
    "GenerationOutput",
    "ModelConfig",
    "PrefillResult",
    "SamplingParams",
    "StepOutput",
    "TokenLogprob",
    "load_model",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'libs.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
