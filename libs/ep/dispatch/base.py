"""Dispatch/combine: moving tokens to the ranks that hold their experts and the results back. `Dispatcher`
is the interface the EP MoE layer (runtime.EPRuntime) calls on every rank, once per MoE layer per forward;
its backends sit beside this module and factory.py picks one."""

# Legend: T tokens on this rank, D hidden, K experts per token, N ranks, S slots per rank, M rows received.
#   d = dispatch(x [T, D], slots [T, K], weights [T, K]); y = this rank's experts over d; out = combine(y, d)
# and nothing else of the group in between. An idle rank calls the pair with `active=False` and no tokens,
# so it still serves the tokens routed to its experts; every backend exchanges activity and token counts in
# a small header first, and `dispatch` returns None when no rank was active (the round is over).
# Layouts of `Dispatched`: "tokens" (M rows, each token once per rank it visits, local slot ids with -1 for
# elsewhere, weights; experts return the weighted sum per row) and "experts" ([S, cap, D] per local expert
# with counts; experts return unweighted rows, combine applies the weights).
# Two-batch overlap (libs/engine/two_batch_overlap.py) uses `dispatch_start` / `combine_start`, whose
# `Pending.wait()` gives what dispatch / combine return; by default they run the whole exchange at once.
# Rounds start in the same order on every rank.
# FP8 dispatch sends DeepSeek's 1x128 format through `quantize_for_dispatch`: the same bytes on every backend.

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from libs.ep.comm import Pending
from libs.quant.fp8 import DEEPEP_MIN_AMAX, quantize_fp8_groups


@dataclass
class Dispatched:
    layout: str  # "tokens" | "experts"
    x: torch.Tensor  # tokens: [M, D]; experts: [S, cap, D]
    local_ids: torch.Tensor | None = None  # tokens: [M, K] local slot or -1
    weights: torch.Tensor | None = None  # tokens: [M, K] float32
    counts: list[int] | None = None  # experts: valid rows per local expert
    handle: Any = None
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None  # x as it came over the wire: FP8 [.., D], scales


class Dispatcher(ABC):
    """Moves tokens to experts and back for one rank of an EP group (see the module docstring)."""

    def dispatch_start(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Pending:
        """dispatch, started: wait() -> its Dispatched (or None)."""
        return Pending.done(self.dispatch(x, slots, weights, active))

    def combine_start(self, y: torch.Tensor, d: Dispatched) -> Pending:
        """combine, started: wait() -> [T, D]."""
        return Pending.done(self.combine(y, d))

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None: ...

    @abstractmethod
    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor: ...

    def set_rounds_per_forward(self, rounds: int, rounds_per_layer: int = 1) -> None:
        """The runtime says how many rounds one forward has (MoE layers x rounds_per_layer: 2 with two-batch
        overlap, micro-batch A's round then B's); a backend may exchange its round header once per forward
        (per micro-batch) instead of once per round (fixed.py does)."""
        return None

    def check(self) -> None:
        """Raise what went wrong on the device since the last call (the runtime calls it after each group
        operation, where the host reads anyway); nothing by default."""
        return None


def peak_tokens(header: Any, active: bool, num_tokens: int) -> int | None:
    """Round header of the fixed-capacity backends (DeepEP, Mooncake EP): every rank says whether it has
    work and how many tokens; None when no rank is active (the round is skipped everywhere), else the
    largest token count, which must fit the backends' per-rank buffer."""
    table = header.all_gather_ints([int(active), num_tokens])
    if not any(row[0] for row in table):
        return None
    return max(row[1] for row in table)


def quantize_for_dispatch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] -> (fp8 [M, D], scales [M, D/128] float32), DeepEP's format; D must be a multiple of 128."""
    return quantize_fp8_groups(x, DEEPEP_MIN_AMAX)
