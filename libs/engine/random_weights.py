"""Random weights in place, on the model's device: for benchmarks and test models at sizes where writing
and reading a checkpoint would take longer than the run. Scales as libs.engine.tiny's checkpoints (fan-in
scaled projections, norms near 1); FP8 weights get 128x128 block scales of about 1/sqrt(K)."""

from __future__ import annotations

import math

import torch

from libs.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX


@torch.no_grad()
def fill_random_(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX):
            continue  # FP8 weights with their scales, below
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.01 * noise)
        elif name == "model.embed_tokens.weight":
            p.copy_(noise)
        elif name.endswith("mlp.gate.weight"):  # the router: float32 values a bf16 checkpoint holds
            p.copy_((noise / math.sqrt(p.shape[-1])).to(torch.bfloat16))
        else:
            p.copy_(noise / math.sqrt(p.shape[-1]))
    for name, p in params.items():
        if p.dtype != FP8_DTYPE:
            continue
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.bfloat16).to(FP8_DTYPE))
        scale = params[name + SCALE_SUFFIX]  # `...weight` and the stacked experts' `...gate_up_proj` alike
        k = p.shape[-1]
        scale.copy_((1 + 0.1 * torch.rand(scale.shape, generator=gen, device=p.device)) / math.sqrt(k))

