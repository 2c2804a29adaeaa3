"""The DeepSeek-V3 engine: model, paged latent KV cache, radix prefix cache, continuous batching, sampling.

`from libs.engine import Engine, SamplingParams`; see engine.py for the offline and incremental APIs.
"""

from libs.engine.config import ModelConfig
from libs.engine.engine import Engine
from libs.engine.loader import load_model
from libs.engine.outputs import GenerationOutput, PrefillResult, StepOutput
from libs.engine.sampling import SamplingParams, TokenLogprob

__all__ = [
    "Engine",
    "GenerationOutput",
    "ModelConfig",
    "PrefillResult",
    "SamplingParams",
    "StepOutput",
    "TokenLogprob",
    "load_model",
]
