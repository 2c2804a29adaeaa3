"""An emulated EP rank for one GPU: the tokens a balanced EP-N deployment would send this rank's experts,
stood in for by this rank's own tokens.

A rank of EP-N with S local experts receives, per MoE layer, about B x K token-expert pairs (its share of
every rank's B tokens x top-K picks, EPLB-balanced). Mapping each of the rank's own picks onto its local
experts (logical id mod S) gives exactly B x K pairs spread evenly over the S experts: the expert GEMMs see
the shapes and counts a real rank sees, with no bytes moved. What it leaves out: the dispatch and combine
traffic itself, and the imbalance a real routing has before EPLB.
"""

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
