"""A new expert placement (eplb.py) applied to a running EP rank between two steps: per MoE layer, every rank
computes the same plan (`plan_layer`, pure) and moves the rows in one all-to-all, in place, then rewrites
the routing tables in place; requests, their KV and their state never move."""

# Legend: L MoE layers, E logical experts, P physical slots per layer, N ranks, S slots per rank, C most copies.
# Each new slot is filled from a slot the rank holds or received from a rank that holds the expert. The
# stacked tensors (bf16/fp32, or FP8 with float32 block scales) travel as raw bytes over the rank's Comm.
# In place (`copy_`) because views into the tensors (the fast path's shared expert stacked after the routed
# ones) and CUDA graphs captured over them must stay valid; every source row is gathered before any slot is
# written, so a slot that is another's source is safe. RoutingTables: log2phy padded to P - E + 1 copies.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from libs.ep.comm import Comm
from libs.ep.placement import Placement


def expert_tensors(ex: Any) -> list[torch.Tensor]:
    """An Experts module's stacked [S, ...] tensors: weights, and for FP8 experts their block scales."""
    names = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
    return [getattr(ex, n).data for n in names if getattr(ex, n, None) is not None]


@dataclass(frozen=True)
class LayerPlan:
    """One rank's part of a layer's move: slots filled from its own old slots, rows it sends (one per
    (destination rank, its old slot), in destination order) and rows it receives (source rank order)."""

    keeps: list[tuple[int, int]]  # (new slot, old slot) on this rank
    sends: list[tuple[int, int]]  # (destination rank, old slot), sorted by destination
    recvs: list[tuple[int, int]]  # (source rank, new slot), sorted by source
    size: int

    def send_rows(self) -> list[int]:
        return [sum(1 for r, _ in self.sends if r == peer) for peer in range(self.size)]

    def recv_rows(self) -> list[int]:
        return [sum(1 for r, _ in self.recvs if r == peer) for peer in range(self.size)]


def plan_layer(old_local: Sequence[Sequence[int]], new_local: Sequence[Sequence[int]], me: int) -> LayerPlan:
    """old_local / new_local [N][S]: each rank's logical expert per slot before and after. A rank keeps what
    it holds; anything else comes from one holder, spread over the holders of a replicated expert."""
    n = len(old_local)
    holders: dict[int, list[int]] = {}
    for r, experts in enumerate(old_local):
        for e in dict.fromkeys(experts):  # a rank holding two copies is one holder
            holders.setdefault(e, []).append(r)
    slot_of = [{e: s for s, e in enumerate(experts)} for experts in old_local]

    def source(r: int, s: int, e: int) -> int:
        if e not in holders:
            raise ValueError(f"expert {e} of the new placement is held by no rank")
        return r if e in slot_of[r] else holders[e][(r + s) % len(holders[e])]

    plan = [(r, s, e, source(r, s, e)) for r in range(n) for s, e in enumerate(new_local[r])]
    keeps = [(s, slot_of[me][e]) for r, s, e, src in plan if r == me and src == me]
    sends = [(r, slot_of[me][e]) for r, _, e, src in plan if src == me and r != me]
    recvs = sorted((src, s) for r, s, _, src in plan if r == me and src != me)
    return LayerPlan(keeps, sends, recvs, n)


def _rows(t: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
    """[len(slots), bytes] uint8 copy of t's rows (t [S, ...] contiguous)."""
    index = torch.tensor(list(slots), dtype=torch.long, device=t.device)
    return t.index_select(0, index).reshape(len(slots), -1).view(torch.uint8)


def move_layer(comm: Comm, plan: LayerPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Fill this rank's slots of every stacked tensor [S, ...] (same S) in place, as `plan` says."""
    if any(not t.is_contiguous() or t.shape[0] != tensors[0].shape[0] for t in tensors):
        raise ValueError("expert stacks must be contiguous [S, ...] tensors of one slot count")
    widths = [t[0].numel() * t.element_size() for t in tensors]
    send_slots = [s for _, s in plan.sends]
    send = torch.cat([_rows(t, send_slots) for t in tensors], dim=1) if send_slots else None
    if send is None:
        send = torch.empty(0, sum(widths), dtype=torch.uint8, device=tensors[0].device)
    kept = [_rows(t, [old for _, old in plan.keeps]) for t in tensors] if plan.keeps else None
    got = comm.all_to_all(send, plan.send_rows(), plan.recv_rows()) if comm.size > 1 else send
    received = torch.split(got, widths, dim=1)
    for i, t in enumerate(tensors):
        raw = t.view(t.shape[0], -1).view(torch.uint8)  # [S, bytes] view of the same storage
        if kept is not None:
            raw[torch.tensor([new for new, _ in plan.keeps], dtype=torch.long, device=t.device)] = kept[i]
        if plan.recvs:
            raw[torch.tensor([s for _, s in plan.recvs], dtype=torch.long, device=t.device)] = received[i]


class RoutingTables:
    """The device tables `Placement.to_physical` reads, at a fixed shape for every placement of one group
    shape (log2phy [L, E, P - E + 1] padded with -1, logcnt [L, E]), so they can be rewritten in place."""

    def __init__(self, placement: Placement, device: torch.device | str) -> None:
        self.width = placement.num_physical - placement.num_logical + 1
        log2phy, logcnt = self._padded(placement)
        self.log2phy, self.logcnt = log2phy.to(device), logcnt.to(device)

    def _padded(self, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        table = placement.log2phy
        out = torch.full((*table.shape[:2], self.width), -1, dtype=table.dtype)
        out[..., : table.shape[2]] = table
        return out, placement.logcnt

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.log2phy, self.logcnt

    def swap(self, placement: Placement) -> None:
        log2phy, logcnt = self._padded(placement)
        if log2phy.shape != self.log2phy.shape:
            raise ValueError(f"placement {placement} does not fit tables of shape {tuple(self.log2phy.shape)}")
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(logcnt)


def apply_placement(
    comm: Comm, old: Placement, new: Placement, layers: Sequence[Sequence[torch.Tensor]],
    tables: RoutingTables | None = None,
) -> None:  # fmt: skip
    """Collective over the group: every MoE layer's stacked expert tensors (layers[j]) moved from `old` to
    `new` in place, then the routing tables swapped. Every rank calls it at the same point."""
    if (new.num_layers, new.num_logical, new.ep_size, new.num_physical) != (
        old.num_layers, old.num_logical, old.ep_size, old.num_physical,
    ):  # fmt: skip
        raise ValueError(f"new placement {new} does not fit the group's {old}")
    if len(layers) != old.num_layers:
        raise ValueError(f"{len(layers)} expert layers for a placement of {old.num_layers}")
    n, me = comm.size, comm.rank
    old_local = [old.local_experts(r).tolist() for r in range(n)]
    new_local = [new.local_experts(r).tolist() for r in range(n)]
    for j, tensors in enumerate(layers):
        plan = plan_layer([o[j] for o in old_local], [nl[j] for nl in new_local], me)
        move_layer(comm, plan, tensors)
    if tables is not None:
        tables.swap(new)
