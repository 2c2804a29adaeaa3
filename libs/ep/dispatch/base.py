"""Dispatch/combine: moving tokens to the ranks that hold their experts and the results back.

Legend: T tokens on this rank, D hidden, K experts per token, N ranks, S slots (physical experts) per rank,
M token rows received by this rank.

Who calls what. The EP MoE layer (runtime.EPRuntime, on every rank) calls, once per MoE layer per forward:
  d = dispatch(x [T, D], slots [T, K] physical slot ids, weights [T, K])   # router -> dispatch
  y = <this rank's experts over d>                                           # local experts
  out = combine(y, d) -> [T, D]                                              # combine
and nothing else of the group in between. A rank with no forward to run (an idle rank in a step) calls the
same pair with `active=False` and no tokens, so that it still serves the tokens routed to its experts;
`dispatch` returns None when no rank of the group was active (the round is over). Every backend exchanges
that activity flag (and each rank's token count) in a small header first, so all ranks agree on it.

`Dispatched` comes in two layouts: "tokens" (DeepEP normal, all-to-all): M rows, each token once per rank it
visits, with local slot ids (-1: the expert lives elsewhere) and weights; the experts return the weighted sum
per row. "experts" (DeepEP/Mooncake low latency): [S, cap, D] rows grouped by local expert with counts; the
experts return [S, cap, D] unweighted and combine applies the weights.

Backends, one module each beside this one: all_to_all.py (`AllToAllDispatcher` over a Comm:
torch.distributed all_to_all_single on gloo/NCCL, or the in-process hub for tests), fixed.py
(`FixedDispatcher`: fixed-capacity buffers, counts and rows exchanged on the device, CUDA-graph capturable;
the default on CUDA), deepep.py
(`DeepEPDispatcher`), mooncake_ep.py (`MooncakeEPDispatcher`). factory.py picks one by name (`make_dispatcher`)
and says clearly when the chosen library is missing.

Two-batch overlap (libs/engine/two_batch_overlap.py) starts a round and finishes it later, computing the
other micro-batch in between: `dispatch_start` / `combine_start` return a `Pending` whose wait() gives what
dispatch / combine return. By default they run the whole exchange at once (no overlap, same results); a
backend with asynchronous collectives overrides them (all_to_all.py). Rounds still start in the same order
on every rank.

FP8 dispatch sends hidden states in DeepSeek's 1x128 format (libs.quant.fp8) with DeepEP's amax floor,
through `quantize_for_dispatch` here, so every backend puts the same bytes on the wire.
"""

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
