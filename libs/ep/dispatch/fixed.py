"""The fixed-capacity dispatch backend ("tokens" layout): every size fixed by shapes and no host sync inside
a round, so a round can be captured in a CUDA graph. Overflow raises a device flag that `check()` turns into
a RuntimeError; a forward with more than max_tokens tokens on some rank takes the fallback dispatcher."""

# Legend: T tokens on this rank (<= max_tokens), D hidden, K experts per token, N ranks, S slots per rank,
# C rows per (sender, receiver) pair, M = N * C rows received, B bytes per row.
# Buffers: rank r sends peer j at most C rows (a token visits a rank once, whatever its K picks there): the
# hidden state (FP8 + 1x128 scales, or the activation dtype), K local slot ids (int32, -1: elsewhere) and K
# weights (float32). C defaults to max_tokens; `capacity_factor` shrinks the buffers, and a pair needing more
# than C drops the rest and raises the flag (the runtime calls `check()` after every group operation).
# One round, on the device: route each token's K slots to ranks (first pick per (token, rank) takes a row,
# the others ride in its id list); counts through one equal-split all_to_all_single; the [N * C, B] payload
# through another; the experts; combine's [M, D] weighted rows back through a third.
# The header (activity, token count) goes once per forward, at its first MoE layer, not per round. A forward
# too large for the buffers takes the fallback (AllToAllDispatcher by default) for all its layers on every
# rank. With two-batch overlap each micro-batch has its own header and its own choice, so max_tokens need
# only hold a micro-batch (rank.py sizes it so). `exchange` + `combine` is the header-free round for callers
# that run every rank in step themselves (CUDA-graph capture, bench/decode_rank).

from __future__ import annotations

import math

import torch

from libs.ep.comm import Comm
from libs.ep.dispatch.base import Dispatched, Dispatcher
from libs.quant.fp8 import DEEPEP_MIN_AMAX, FP8_DTYPE, FP8_GROUP, dequantize_fp8_groups, quantize_fp8_groups


def _row_bytes(hidden: int, top_k: int, dtype: torch.dtype, fp8: bool) -> tuple[int, int]:
    """(bytes of the hidden part, bytes per row padded to 16)."""
    x = hidden + 4 * (hidden // FP8_GROUP) if fp8 else hidden * torch.empty((), dtype=dtype).element_size()
    return x, -(-(x + 8 * top_k) // 16) * 16


class FixedDispatcher(Dispatcher):
    """Dispatch/combine over fixed [N * C, B] buffers with equal-split all-to-alls (module docstring)."""

    def __init__(
        self, comm: Comm, slots_per_rank: int, *, hidden: int, top_k: int, dtype: torch.dtype, max_tokens: int,
        fp8: bool = False, combine_dtype: torch.dtype | None = None, capacity_factor: float | None = None,
        fallback: Dispatcher | None = None,
    ) -> None:  # fmt: skip
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if fp8 and hidden % FP8_GROUP:
            raise ValueError(f"FP8 dispatch needs hidden divisible by {FP8_GROUP}, got {hidden}")
        n = comm.size
        self.comm, self.slots_per_rank, self.hidden, self.top_k = comm, slots_per_rank, hidden, top_k
        self.dtype, self.max_tokens, self.fp8, self.combine_dtype = dtype, max_tokens, fp8, combine_dtype
        if capacity_factor is None:
            self.capacity = max_tokens
        elif capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        else:
            self.capacity = min(max_tokens, math.ceil(max_tokens * min(top_k, n) * capacity_factor / n))
        self.x_bytes, self.row_bytes = _row_bytes(hidden, top_k, dtype, fp8)
        self.fallback = fallback
        self.rounds_per_forward, self.rounds_per_layer = 1, 1
        self._round = 0
        self._use_fallback = [False]  # per micro-batch of the current forward (round % rounds_per_layer)
        self.overflow: torch.Tensor | None = None  # device bool, set when a pair needed more than C rows

    # --- the lockstep interface (runtime.py) ---
    def set_rounds_per_forward(self, rounds: int, rounds_per_layer: int = 1) -> None:
        self.rounds_per_forward = max(1, rounds)
        self.rounds_per_layer = max(1, min(rounds_per_layer, self.rounds_per_forward))
        self._use_fallback = [False] * self.rounds_per_layer

    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None:
        at = self._round % self.rounds_per_forward
        part = at % self.rounds_per_layer  # the micro-batch this round belongs to
        if at < self.rounds_per_layer:  # a (micro-batch of a) forward starts, or the operation ends, here
            table = self.comm.all_gather_ints([int(active), x.shape[0]])
            if at == 0 and not any(row[0] for row in table):
                self._round = 0
                return None
            peak = max(row[1] for row in table)
            self._use_fallback[part] = peak > self.max_tokens
            if self._use_fallback[part] and self.fallback is None:
                raise ValueError(
                    f"{peak} tokens on one rank exceed the EP dispatcher's max_tokens {self.max_tokens} and it "
                    "has no fallback"
                )
        self._round += 1
        if self._use_fallback[part]:
            assert self.fallback is not None
            d = self.fallback.dispatch(x, slots, weights, active)
            if d is None:  # every rank stopped in the middle of a forward (a failed one): the op is over
                self._round = 0
                return None
            return Dispatched(d.layout, d.x, d.local_ids, d.weights, d.counts, handle=("fallback", d))
        return self.exchange(x, slots, weights)

    def combine(self, y: torch.Tensor, d: Dispatched, add: torch.Tensor | None = None) -> torch.Tensor:
        if d.handle[0] == "fallback":
            assert self.fallback is not None
            out = self.fallback.combine(y, d.handle[1])
            return out if add is None else out + add
        _, send_row, t, dtype = d.handle
        n, cap = self.comm.size, self.capacity
        wire = y.to(self.combine_dtype or y.dtype).contiguous()
        back = torch.empty(n * cap + 1, wire.shape[1], dtype=wire.dtype, device=wire.device)
        back[-1].zero_()  # the scratch row: picks that sent no row read zeros
        self.comm.all_to_all_equal(_bytes(back[:-1]), _bytes(wire))
        out = back[send_row].view(t, self.top_k, back.shape[1]).float().sum(1)
        if add is not None:
            out += add.float()
        return out.to(dtype)

    def check(self) -> None:
        """Raise if any round since the last check needed more than C rows for one peer (one host read)."""
        if self.overflow is not None and bool(self.overflow):
            self.overflow = None
            raise RuntimeError(
                f"EP dispatch overflow: a rank had more than {self.capacity} rows for one peer in a round "
                f"(capacity_factor too small for this routing); that operation's MoE outputs are incomplete"
            )

    # --- one round, no host reads ---
    def exchange(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        """x [T, D], slots [T, K] physical, weights [T, K] -> the rows this rank's experts serve ("tokens":
        x [M, D], local ids [M, K] with -1 for rows past each sender's count, weights [M, K])."""
        t, k = slots.shape
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens exceed the EP dispatcher's max_tokens {self.max_tokens}")
        if x.shape != (t, self.hidden) or k != self.top_k:
            raise ValueError(f"dispatch of x {tuple(x.shape)}, slots {tuple(slots.shape)}: expected D "
                             f"{self.hidden}, K {self.top_k}")  # fmt: skip
        send_row, counts, meta = self._route(slots, weights)
        send = self._pack(x, send_row, meta)
        recv_counts = torch.empty_like(counts)
        self.comm.all_to_all_equal(_bytes(recv_counts[:, None]), _bytes(counts[:, None]))
        recv = torch.empty_like(send[:-1])
        self.comm.all_to_all_equal(recv, send[:-1])
        return self._unpack(recv, recv_counts, handle=("fixed", send_row, t, x.dtype))

    def _route(self, slots: torch.Tensor, weights: torch.Tensor):
        """-> send row per pick [T*K] (the scratch row N*C for picks that send none), rows per peer [N] int32,
        each pick's row metadata [T, K, 8K] bytes (local ids of the experts on that rank, their weights)."""
        n, s, cap = self.comm.size, self.slots_per_rank, self.capacity
        t, k = slots.shape
        slots = slots.long()
        dest = slots // s  # [T, K] rank of each pick
        same = dest[:, :, None] == dest[:, None, :]  # [T, K, K]: picks sharing a rank
        first = ~torch.tril(same, diagonal=-1).any(-1)  # [T, K]: no earlier pick of that rank
        visits = torch.zeros(t, n, dtype=torch.int32, device=slots.device).scatter_(1, dest, 1)  # [T, N]
        want = visits.sum(0)  # [N]
        row = (visits.cumsum(0) - 1).gather(1, dest)  # [T, K]: the token's row in that rank's block
        ok = first & (row < cap)
        send_row = torch.where(ok, dest * cap + row, n * cap).flatten()
        over = (want > cap).any()
        self.overflow = over if self.overflow is None else self.overflow | over
        ids = torch.where(same, (slots % s)[:, None, :], -1).to(torch.int32)  # [T, K, K]
        w = torch.where(same, weights.float()[:, None, :], 0.0)
        meta = torch.cat([ids.view(torch.uint8), w.view(torch.uint8)], dim=-1)  # [T, K, 8K]
        return send_row, want.clamp(max=cap).to(torch.int32), meta

    def _pack(self, x: torch.Tensor, send_row: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """[N*C + 1, B] bytes: each token's hidden part and each pick's metadata at its rows (last: scratch)."""
        t, k = meta.shape[:2]
        n, cap = self.comm.size, self.capacity
        send = torch.empty(n * cap + 1, self.row_bytes, dtype=torch.uint8, device=x.device)
        if t == 0:  # an idle rank: nothing to write (empty FP8 scales may not even view as bytes)
            return send
        if self.fp8:
            q, sc = quantize_fp8_groups(x, DEEPEP_MIN_AMAX)
            hidden = torch.cat([q.view(torch.uint8), sc.view(torch.uint8)], dim=1)
        else:
            hidden = x.contiguous().view(torch.uint8)
        per_pick = hidden[:, None, :].expand(t, k, self.x_bytes).reshape(t * k, self.x_bytes)
        send[:, : self.x_bytes].index_copy_(0, send_row, per_pick)
        send[:, self.x_bytes : self.x_bytes + 8 * k].index_copy_(0, send_row, meta.reshape(t * k, 8 * k))
        return send

    def _unpack(self, recv: torch.Tensor, recv_counts: torch.Tensor, handle) -> Dispatched:
        cap, d, k = self.capacity, self.hidden, self.top_k
        valid = (torch.arange(cap, device=recv.device)[None, :] < recv_counts[:, None]).flatten()[:, None]
        meta = recv[:, self.x_bytes : self.x_bytes + 8 * k].contiguous()
        ids = torch.where(valid, meta[:, : 4 * k].view(torch.int32), -1).long()
        w = torch.where(valid, meta[:, 4 * k :].view(torch.float32), 0.0)
        quantized = None
        if self.fp8:
            q = recv[:, :d].contiguous().view(FP8_DTYPE)
            sc = recv[:, d : self.x_bytes].contiguous().view(torch.float32)
            x = dequantize_fp8_groups(q, sc, self.dtype)
            quantized = (q, sc)
        else:
            x = recv[:, : self.x_bytes].contiguous().view(self.dtype)
        return Dispatched("tokens", x, ids, w, handle=handle, quantized=quantized)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows as [R, bytes] uint8."""
    return t.contiguous().view(t.shape[0], -1).view(torch.uint8)
