"""An emulated EP rank for one GPU: each of the rank's own top-K picks mapped onto its S local experts
(logical id mod S), so the expert GEMMs see the B x K evenly spread pairs a balanced EP-N rank receives.
It leaves out the dispatch and combine traffic, and routing's imbalance before EPLB."""

from __future__ import annotations

import torch


class EmulatedEP:
    def __init__(self, local_experts: int) -> None:
        if local_experts < 1:
            raise ValueError(f"an EP rank needs at least one local expert, got {local_experts}")
        self.local_experts = local_experts

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed logical expert ids [T, K] -> local expert ids [T, K] (graph-safe: one device op)."""
        return ids % self.local_experts


def enable_emulated_ep(model, local_experts: int) -> int:
    """Make every fused MoE layer of `model` (built with `local_experts` routed experts per layer, e.g. by
    libs.ep.runtime.shard_experts) take its tokens through an EmulatedEP; -> the number of layers set."""
    mapping = EmulatedEP(local_experts)
    n = 0
    for layer in model.model.layers:
        fast = getattr(layer.mlp, "fast", None)
        if fast is not None:
            fast.emulate_ep = mapping
            n += 1
    return n
