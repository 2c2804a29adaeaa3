"""EP MoE hooks for ranks that run every forward in step, so no round needs a header: one forward is L
fixed-capacity rounds with no host reads (`graph_safe`), what a decode CUDA graph captures and what
bench/decode_rank runs. Ranks with uneven work (prefill, idle ranks) take runtime.py's lockstep."""

# Legend: T tokens, K experts per token, D hidden, S local slots.
# `SteppedEPHook` is layer j's `MoE.ep`: router picks -> optional remap (an emulated EP-N rank's ids mod S)
# -> physical slots -> FixedDispatcher.exchange -> FP8 experts (experts.run_fp8_experts) -> combine, plus
# the shared expert; load counted by scatter-add.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from libs.ep.dispatch.fixed import FixedDispatcher
from libs.ep.experts import count_load, run_fp8_experts
from libs.ep.placement import Placement
from libs.ep.runtime import moe_layers


class SteppedEPHook:
    graph_safe = True

    def __init__(
        self, dispatcher: FixedDispatcher, experts: Any, placement: Placement, rank: int, j: int,
        tables: tuple[torch.Tensor, torch.Tensor], load: torch.Tensor,
        remap: Callable[[torch.Tensor], torch.Tensor] | None = None, rows_per_expert_factor: int = 1,
    ) -> None:  # fmt: skip
        self.dispatcher, self.experts, self.placement, self.rank, self.j = dispatcher, experts, placement, rank, j
        self.tables, self.load, self.remap = tables, load, remap
        self.rows_per_expert_factor = rows_per_expert_factor

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.remap is not None:
            ids = self.remap(ids)
        count_load(self.load, ids)
        slots = self.placement.to_physical(self.j, ids, self.rank, self.tables)
        d = self.dispatcher.exchange(x, slots, weights)
        y = run_fp8_experts(self.experts, d, d.x.shape[0] * self.rows_per_expert_factor)
        return self.dispatcher.combine(y, d, add=add)


def enable_stepped_ep(
    model: Any, placement: Placement, rank: int, dispatcher: FixedDispatcher,
    remap: Callable[[torch.Tensor], torch.Tensor] | None = None, rows_per_expert_factor: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Set every MoE layer's `ep` to a SteppedEPHook (experts already this rank's FP8 slots, set before the
    Engine is built so its decode graphs include the hooks); -> the [L, E] expert-load counter they fill.
    rows_per_expert_factor: K when `remap` can send one token's picks to one local expert more than once."""
    layers = moe_layers(model)
    if len(layers) != placement.num_layers:
        raise ValueError(f"placement has {placement.num_layers} MoE layers, the model {len(layers)}")
    if not all(moe.experts.is_fp8 for _, moe in layers):
        raise ValueError("stepped EP runs FP8 experts (the grouped GEMMs): load the model with FP8 weights")
    device = layers[0][1].experts.gate_up_proj.device
    tables = placement.device_tables(device)
    load = torch.zeros(len(layers), placement.num_logical, dtype=torch.int64, device=device)
    for j, (_, moe) in enumerate(layers):
        moe.ep = SteppedEPHook(
            dispatcher, moe.experts, placement, rank, j, tables, load[j], remap, rows_per_expert_factor
        )
    return load
