"""Expert placement: which logical expert each physical slot holds, per MoE layer. Rank r owns slots
[r*S, (r+1)*S); every logical expert has at least one slot, some several (EPLB's copies); every rank of a
group holds the same Placement, swapped in on all at the same step boundary."""

# Legend: L MoE layers, E logical (routed) experts, P physical slots per layer (P divisible by N), N EP
# ranks, S = P / N slots per rank, T tokens, K experts per token.
# The front builds the placement and sends it as plain lists (`to_wire` / `from_wire`). `to_physical`
# spreads a logical expert's tokens evenly over its copies (copy = (token index + rank) mod copies), the even
# split EPLB assumes when it decides how many copies an expert gets.

from __future__ import annotations

from collections.abc import Sequence

import torch


class Placement:
    def __init__(self, phy2log: Sequence[Sequence[int]] | torch.Tensor, num_logical: int, ep_size: int):
        """phy2log [L, P]: the logical expert in each physical slot. ValueError if it is not a placement."""
        table = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
        if table.dim() != 2 or table.shape[1] == 0:
            raise ValueError(f"phy2log must be [layers, physical slots], got shape {tuple(table.shape)}")
        if ep_size < 1 or table.shape[1] % ep_size:
            raise ValueError(f"{table.shape[1]} physical experts do not divide over {ep_size} EP ranks")
        if table.shape[1] < num_logical:
            raise ValueError(f"{table.shape[1]} physical slots cannot hold {num_logical} logical experts")
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_logical):
            raise ValueError(f"phy2log holds expert ids outside 0..{num_logical - 1}")
        self.phy2log = table
        self.num_logical, self.ep_size = num_logical, ep_size
        self.logcnt = torch.stack([torch.bincount(row, minlength=num_logical) for row in table])  # [L, E]
        if table.shape[0] and int(self.logcnt.min()) == 0:
            layer, expert = (self.logcnt == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} has no physical slot in MoE layer {layer}")
        self.log2phy = self._inverse()  # [L, E, max copies], -1 padded

    def _inverse(self) -> torch.Tensor:
        copies = int(self.logcnt.max()) if self.phy2log.shape[0] else 1
        out = torch.full((self.num_layers, self.num_logical, copies), -1, dtype=torch.int64)
        for layer, row in enumerate(self.phy2log.tolist()):
            seen = [0] * self.num_logical
            for slot, expert in enumerate(row):
                out[layer, expert, seen[expert]] = slot
                seen[expert] += 1
        return out

    @classmethod
    def uniform(cls, num_layers: int, num_logical: int, ep_size: int, num_redundant: int = 0) -> Placement:
        """Slot p holds expert p mod E: expert e on rank e // S, the first `num_redundant` experts copied
        into the last slots (the start-up placement, before any load is known)."""
        if num_redundant < 0:
            raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
        num_physical = num_logical + num_redundant
        row = [p % num_logical for p in range(num_physical)]
        return cls([row] * num_layers, num_logical, ep_size)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def local_experts(self, rank: int) -> torch.Tensor:
        """[L, S] logical expert held by each of `rank`'s slots."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} is outside the EP group of {self.ep_size}")
        s = self.slots_per_rank
        return self.phy2log[:, rank * s : (rank + 1) * s]

    def to_physical(
        self, layer: int, ids: torch.Tensor, rank: int, tables: tuple | None = None
    ) -> torch.Tensor:
        """ids [T, K] logical -> [T, K] physical slots. `tables` = (log2phy, logcnt) already on ids' device."""
        log2phy, logcnt = tables if tables is not None else (self.log2phy, self.logcnt)
        ids = ids.to(torch.int64)
        copies = logcnt[layer][ids]  # [T, K]
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        return log2phy[layer][ids, (token + rank) % copies]

    def device_tables(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.log2phy.to(device), self.logcnt.to(device)

    def rank_loads(self, load: torch.Tensor) -> torch.Tensor:
        """load [L, E] tokens per logical expert -> [L, N] tokens per rank, each expert's load split evenly
        over its copies (what `to_physical` does)."""
        load = torch.as_tensor(load, dtype=torch.float64)
        if tuple(load.shape) != (self.num_layers, self.num_logical):
            raise ValueError(f"load must be [{self.num_layers}, {self.num_logical}], got {tuple(load.shape)}")
        per_slot = (load / self.logcnt).gather(1, self.phy2log)  # [L, P]
        return per_slot.view(self.num_layers, self.ep_size, -1).sum(-1)

    def imbalance(self, load: torch.Tensor) -> float:
        """Max/mean tokens per rank, averaged over layers (1.0 is perfect balance; layers with no load skip)."""
        ranks = self.rank_loads(load)
        mean = ranks.mean(-1)
        busy = mean > 0
        if not bool(busy.any()):
            return 1.0
        return float((ranks.max(-1).values[busy] / mean[busy]).mean())

    def to_wire(self) -> tuple[list[list[int]], int, int]:
        return self.phy2log.tolist(), self.num_logical, self.ep_size

    @classmethod
    def from_wire(cls, wire: tuple[list[list[int]], int, int]) -> Placement:
        phy2log, num_logical, ep_size = wire
        return cls(phy2log, num_logical, ep_size)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and (self.num_logical, self.ep_size) == (other.num_logical, other.ep_size)
            and torch.equal(self.phy2log, other.phy2log)
        )

    def __repr__(self) -> str:
        return (
            f"Placement(layers={self.num_layers}, logical={self.num_logical}, physical={self.num_physical}, "
            f"ep_size={self.ep_size})"
        )
