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

Backends: `AllToAllDispatcher` over a Comm (torch.distributed all_to_all_single on gloo/NCCL, or the
in-process hub for tests); `deepep.DeepEPDispatcher`; `mooncake_ep.MooncakeEPDispatcher`. `make_dispatcher`
picks one by name and says clearly when the chosen library is missing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from libs.ep.comm import Comm

BACKENDS = ("torch", "deepep", "mooncake")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_GROUP = 128


@dataclass
class Dispatched:
    layout: str  # "tokens" | "experts"
    x: torch.Tensor  # tokens: [M, D]; experts: [S, cap, D]
    local_ids: torch.Tensor | None = None  # tokens: [M, K] local slot or -1
    weights: torch.Tensor | None = None  # tokens: [M, K] float32
    counts: list[int] | None = None  # experts: valid rows per local expert
    handle: Any = None


class Dispatcher(ABC):
    """Moves tokens to experts and back for one rank of an EP group (see the module docstring)."""

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None: ...

    @abstractmethod
    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor: ...


def peak_tokens(header: Any, active: bool, num_tokens: int) -> int | None:
    """Round header of the fixed-capacity backends (DeepEP, Mooncake EP): every rank says whether it has
    work and how many tokens; None when no rank is active (the round is skipped everywhere), else the
    largest token count, which must fit the backends' per-rank buffer."""
    table = header.all_gather_ints([int(active), num_tokens])
    if not any(row[0] for row in table):
        return None
    return max(row[1] for row in table)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] -> (fp8 [M, D], scales [M, D/128] float32) with one scale per 128 values (DeepEP's format)."""
    m, d = x.shape
    if d % FP8_GROUP:
        raise ValueError(f"FP8 dispatch needs hidden size divisible by {FP8_GROUP}, got {d}")
    groups = x.float().view(m, d // FP8_GROUP, FP8_GROUP)
    amax = groups.abs().amax(-1).clamp(min=1e-4)  # [M, D/128]
    q = (groups * (FP8_MAX / amax[..., None])).to(FP8).view(m, d)
    return q, amax / FP8_MAX


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    shape = q.shape
    groups = q.float().view(*shape[:-1], -1, FP8_GROUP) * scales[..., None]
    return groups.view(shape).to(dtype)


class AllToAllDispatcher(Dispatcher):
    """Dispatch/combine with `all_to_all_single`: a header all-gather (activity, token count, rows per
    destination), one all-to-all of packed byte rows (hidden state, FP8 scales, slot ids, weights), one
    all-to-all back. Each token travels once per destination rank, not once per expert."""

    def __init__(self, comm: Comm, slots_per_rank: int, fp8: bool = False, combine_dtype=None) -> None:
        self.comm, self.slots_per_rank = comm, slots_per_rank
        self.fp8, self.combine_dtype = fp8, combine_dtype

    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None:
        n, s, me = self.comm.size, self.slots_per_rank, self.comm.rank
        t, k = slots.shape
        dest = slots // s  # [T, K] rank of each chosen expert
        visits = torch.zeros(t, n, dtype=torch.bool, device=x.device).scatter_(1, dest, True)  # [T, N]
        to_rank, token = visits.t().nonzero(as_tuple=True)  # send rows, grouped by destination rank
        send_rows = torch.bincount(to_rank, minlength=n).tolist()
        table = self.comm.all_gather_ints([int(active), t, *send_rows])
        if not any(row[0] for row in table):
            return None
        recv_rows = [row[2 + me] for row in table]
        here = dest[token] == to_rank[:, None]  # [R, K] which of a row's experts live on its destination
        ids = torch.where(here, slots[token] % s, -1).to(torch.int32)
        w = torch.where(here, weights[token].float(), 0.0)
        packed = self._pack(x, token, ids, w)
        got = self.comm.all_to_all(packed, send_rows, recv_rows)
        rx, rids, rw = self._unpack(got, x.shape[1], k, x.dtype)
        return Dispatched("tokens", rx, rids.long(), rw, handle=(token, send_rows, recv_rows, t, x.dtype))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        token, send_rows, recv_rows, t, dtype = d.handle
        wire = y.to(self.combine_dtype) if self.combine_dtype is not None else y
        back = self.comm.all_to_all(wire, recv_rows, send_rows)  # [R, D], in send order
        out = torch.zeros(t, y.shape[-1], dtype=dtype, device=y.device)
        return out.index_add_(0, token, back.to(dtype))

    def _pack(self, x: torch.Tensor, token: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[R, bytes]: rows x[token] as hidden (or fp8 + scales) | ids int32 | weights float32. FP8 quantizes
        each token once, before the gather, however many ranks it visits."""
        rows = [p.contiguous().view(torch.uint8)[token] for p in (quantize_fp8(x) if self.fp8 else [x])]
        return torch.cat([*rows, *(p.contiguous().view(torch.uint8) for p in (ids, w))], dim=1)

    def _unpack(self, got: torch.Tensor, d: int, k: int, dtype: torch.dtype):
        cuts = [d, 4 * d // FP8_GROUP] if self.fp8 else [d * torch.empty((), dtype=dtype).element_size()]
        cuts += [4 * k, 4 * k]
        parts = torch.split(got, cuts, dim=1)
        ids, w = parts[-2].view(torch.int32), parts[-1].view(torch.float32)
        if self.fp8:
            x = dequantize_fp8(parts[0].view(FP8), parts[1].view(torch.float32), dtype)
        else:
            x = parts[0].view(dtype)
        return x, ids, w


def make_dispatcher(
    backend: str, comm: Comm, *, slots_per_rank: int, num_physical: int, hidden: int,
    dtype: torch.dtype, fp8: bool = False, group=None, **options: Any,
) -> Dispatcher:  # fmt: skip
    """The dispatcher named by `backend` ("torch", "deepep", "mooncake"). DeepEP and Mooncake EP need their
    libraries and CUDA; a missing one is a RuntimeError naming what to install."""
    if backend == "torch":
        return AllToAllDispatcher(comm, slots_per_rank, fp8=fp8, combine_dtype=options.get("combine_dtype"))
    if backend == "deepep":
        from libs.ep.deepep import DeepEPDispatcher

        return DeepEPDispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
    if backend == "mooncake":
        from libs.ep.mooncake_ep import MooncakeEPDispatcher

        return MooncakeEPDispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
    raise ValueError(f"unknown EP dispatch backend {backend!r}: use one of {BACKENDS}")
