"""The all-to-all dispatch backend: token rows packed into bytes and exchanged with `all_to_all_single` over a
Comm (torch.distributed on gloo/NCCL, or the in-process hub in tests). Works everywhere torch does; the
"tokens" layout of base.py."""

from __future__ import annotations

import torch

from libs.ep.comm import Comm, Pending
from libs.ep.dispatch.base import Dispatched, Dispatcher, quantize_for_dispatch
from libs.quant.fp8 import FP8_DTYPE, FP8_GROUP, dequantize_fp8_groups


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
        return self.dispatch_start(x, slots, weights, active).wait()

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        return self.combine_start(y, d).wait()

    def dispatch_start(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Pending:
        """The header on the host at once; the rows' all-to-all started (asynchronous over torch.distributed)."""
        n, s, me = self.comm.size, self.slots_per_rank, self.comm.rank
        t, k = slots.shape
        dest = slots // s  # [T, K] rank of each chosen expert
        visits = torch.zeros(t, n, dtype=torch.bool, device=x.device).scatter_(1, dest, True)  # [T, N]
        to_rank, token = visits.t().nonzero(as_tuple=True)  # send rows, grouped by destination rank
        send_rows = torch.bincount(to_rank, minlength=n).tolist()
        table = self.comm.all_gather_ints([int(active), t, *send_rows])
        if not any(row[0] for row in table):
            return Pending.done(None)
        recv_rows = [row[2 + me] for row in table]
        here = dest[token] == to_rank[:, None]  # [R, K] which of a row's experts live on its destination
        ids = torch.where(here, slots[token] % s, -1).to(torch.int32)
        w = torch.where(here, weights[token].float(), 0.0)
        packed = self._pack(x, token, ids, w)
        handle = (token, send_rows, recv_rows, t, x.dtype)

        def unpack(got: torch.Tensor) -> Dispatched:
            rx, rids, rw = self._unpack(got, x.shape[1], k, x.dtype)
            return Dispatched("tokens", rx, rids.long(), rw, handle=handle)

        return self.comm.all_to_all_start(packed, send_rows, recv_rows).then(unpack)

    def combine_start(self, y: torch.Tensor, d: Dispatched) -> Pending:
        token, send_rows, recv_rows, t, dtype = d.handle
        wire = y.to(self.combine_dtype) if self.combine_dtype is not None else y

        def add_up(back: torch.Tensor) -> torch.Tensor:  # [R, D], in send order
            out = torch.zeros(t, y.shape[-1], dtype=dtype, device=y.device)
            return out.index_add_(0, token, back.to(dtype))

        return self.comm.all_to_all_start(wire, recv_rows, send_rows).then(add_up)

    def _pack(self, x: torch.Tensor, token: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[R, bytes]: rows x[token] as hidden (or fp8 + scales) | ids int32 | weights float32. FP8 quantizes
        each token once, before the gather, however many ranks it visits."""
        rows = [_bytes(p)[token] for p in (quantize_for_dispatch(x) if self.fp8 else [x])]
        return torch.cat([*rows, *(_bytes(p) for p in (ids, w))], dim=1)

    def _unpack(self, got: torch.Tensor, d: int, k: int, dtype: torch.dtype):
        cuts = [d, 4 * d // FP8_GROUP] if self.fp8 else [d * torch.empty((), dtype=dtype).element_size()]
        cuts += [4 * k, 4 * k]
        parts = torch.split(got, cuts, dim=1)
        ids, w = parts[-2].view(torch.int32), parts[-1].view(torch.float32)
        if self.fp8:
            x = dequantize_fp8_groups(parts[0].view(FP8_DTYPE), parts[1].view(torch.float32), dtype)
        else:
            x = parts[0].view(dtype)
        return x, ids, w


def _bytes(p: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [R, C * itemsize] uint8 (an empty one too: its strides may not allow the view)."""
    if p.numel() == 0:
        return torch.empty(p.shape[0], p.shape[1] * p.element_size(), dtype=torch.uint8, device=p.device)
    return p.contiguous().view(torch.uint8)
