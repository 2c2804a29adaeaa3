"""One rank's expert parallelism: the model's MoE hook (router -> dispatch -> local experts -> combine), the
lockstep rounds, expert load and placement swaps, applied from outside the model (`shard_experts`,
`enable_expert_parallel`); attention, dense layers and shared experts stay data-parallel."""

# Legend: T tokens, D hidden, K experts per token, L MoE layers, E logical experts, S local slots.
# Lockstep: every MoE layer is a collective, so within a group operation rank r's forward f reaches layer j
# in round f*L + j (a round: one dispatch + combine). A rank out of forwards calls `idle_until_all_done`,
# joining each further round with no tokens (serving layer round mod L) until a round with no rank active,
# which ends the operation everywhere: no forward counts or sizes are agreed in advance. With two-batch
# overlap (`tbo`, on every rank or none) a layer is two rounds, A's then B's (`moe_stages`), and an idle
# rank serves layer (round // 2) mod L. A failing local expert computation still completes its combine.

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from libs.engine.two_batch_overlap import run_alone
from libs.ep.comm import Comm
from libs.ep.dispatch.base import Dispatched, Dispatcher
from libs.ep.experts import count_load, run_fp8_experts, run_local_experts
from libs.ep.placement import Placement
from libs.ep.rebalance import RoutingTables, apply_placement, expert_tensors

log = logging.getLogger("moemesh.ep")


def moe_layers(model: Any) -> list[tuple[int, Any]]:
    """(decoder layer id, its MoE block) for every layer with routed experts, in forward order."""
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def shard_experts(model: Any, placement: Placement, rank: int, copy: bool = True) -> None:
    """Replace each MoE layer's stacked experts [E, ...] by this rank's slots [S, ...]: copies of the loaded
    weights (copy=True), or uninitialized tensors a loader fills (copy=False)."""
    layers = moe_layers(model)
    if len(layers) != placement.num_layers:
        raise ValueError(f"placement has {placement.num_layers} MoE layers, the model {len(layers)}")
    local = placement.local_experts(rank)
    for j, (_, moe) in enumerate(layers):
        ex = moe.experts
        for name in expert_param_names(ex):
            full = getattr(ex, name)
            if copy:
                part = full.data[local[j].to(full.device)].clone()
            else:
                part = torch.empty(local.shape[1], *full.shape[1:], dtype=full.dtype, device=full.device)
            setattr(ex, name, nn.Parameter(part, requires_grad=False))


def expert_param_names(ex: Any) -> tuple[str, ...]:
    """The stacked [E, ...] parameters of an Experts module (FP8 ones carry their block scales)."""
    names = ("gate_up_proj", "down_proj")
    return names + ("gate_up_proj_scale_inv", "down_proj_scale_inv") if ex.is_fp8 else names


class EPMoEHook:
    """What `MoE.ep` is set to: layer j's call into the rank's runtime."""

    def __init__(self, runtime: EPRuntime, j: int) -> None:
        self.runtime, self.j = runtime, j

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.runtime.moe(self.j, x, ids, weights, add)

    def stages(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """The same call in stages, for two-batch overlap (EPRuntime.moe_stages)."""
        return self.runtime.moe_stages(self.j, x, ids, weights)


class EPRuntime:
    def __init__(
        self, model: Any, placement: Placement, rank: int, dispatcher: Dispatcher, comm: Comm
    ) -> None:
        """model: a DeepseekV3ForCausalLM whose experts are already this rank's slots."""
        cfg = model.config
        self.model = model
        self.rank, self.placement, self.dispatcher, self.comm = rank, placement, dispatcher, comm
        self.layers = moe_layers(model)
        self.experts = [moe.experts for _, moe in self.layers]
        self.device, self.dtype = model.device, model.dtype
        self.hidden, self.top_k = cfg.hidden_size, cfg.num_experts_per_tok
        self.routing = RoutingTables(placement, self.device)  # rewritten in place by apply_placement
        self.tables = self.routing.as_tuple()
        self.load = torch.zeros(
            len(self.layers), placement.num_logical, dtype=torch.int64, device=self.device
        )
        self.rounds = 0
        dispatcher.set_rounds_per_forward(len(self.layers))  # begin_op resets it per operation (TBO: x2)
        self.deferred_failure: Exception | None = None  # a local-expert failure under TBO, raised after the op

    # --- the model side: one MoE layer of an active forward ---
    @property
    def rounds_per_layer(self) -> int:
        return 2 if getattr(self.model, "tbo", None) is not None else 1

    def layer_of_round(self, r: int) -> int:
        return (r // self.rounds_per_layer) % len(self.experts)

    def moe(
        self, j: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, K] (logical experts from the router) -> routed experts' output [T, D]
        (+ add: the shared expert's output, which FP8 MoEs hand over)."""
        out = run_alone(self.moe_stages(j, x, ids, weights))
        return out if add is None else out + add

    def moe_stages(self, j: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """`moe` as a generator that yields after starting the dispatch and after starting the combine."""
        if j != self.layer_of_round(self.rounds):
            raise RuntimeError(
                f"EP lockstep broken: MoE layer {j} in round {self.rounds} on rank {self.rank}"
            )
        count_load(self.load[j], ids)
        slots = self.placement.to_physical(j, ids, self.rank, self.tables)
        self.rounds += 1
        pending = self.dispatcher.dispatch_start(x, slots, weights, active=True)
        yield
        d = pending.wait()
        if d is None:
            raise RuntimeError("dispatch reported no active rank while this rank was active")
        y, failure = self._local_experts(j, d)
        combined = self.dispatcher.combine_start(y, d)
        yield
        out = combined.wait()
        if failure is not None:
            if self.rounds_per_layer == 1:
                raise failure
            # two micro-batches: the other one's rounds are already started; finish the forward (this layer's
            # routed output zero) and raise once every rank is done (idle_until_all_done)
            self.deferred_failure = self.deferred_failure or failure
        return out

    def _local_experts(self, j: int, d: Dispatched) -> tuple[torch.Tensor, Exception | None]:
        """This rank's experts over what arrived; on failure zeros, so the combine still happens."""
        ex = self.experts[j]
        try:
            y = run_fp8_experts(ex, d) if ex.is_fp8 else run_local_experts(ex.gate_up_proj, ex.down_proj, d)
            return y, None
        except Exception as e:
            return torch.zeros_like(d.x), e

    def _serve(self, j: int, d: Dispatched) -> tuple[torch.Tensor, Exception | None]:
        """Local experts over what arrived, then combine; the combine happens even if the experts fail."""
        self.rounds += 1
        y, failure = self._local_experts(j, d)
        return self.dispatcher.combine(y, d), failure

    # --- the group side ---
    def begin_op(self) -> None:
        self.rounds = 0
        # backends that exchange their round header once per forward count its rounds (two per layer with TBO)
        set_rounds = getattr(self.dispatcher, "set_rounds_per_forward", None)
        if set_rounds is not None:
            set_rounds(len(self.experts) * self.rounds_per_layer, self.rounds_per_layer)

    def idle_until_all_done(self) -> None:
        """Serve other ranks' rounds with no tokens of our own until a round where nobody is active."""
        x = torch.empty(0, self.hidden, dtype=self.dtype, device=self.device)
        slots = torch.empty(0, self.top_k, dtype=torch.int64, device=self.device)
        weights = torch.empty(0, self.top_k, dtype=torch.float32, device=self.device)
        while (d := self.dispatcher.dispatch(x, slots, weights, active=False)) is not None:
            _, failure = self._serve(self.layer_of_round(self.rounds), d)
            if failure is not None:
                log.error("rank %d: local experts failed while serving an idle round: %s", self.rank, failure)
        self.rounds = 0
        self.dispatcher.check()
        failure, self.deferred_failure = self.deferred_failure, None
        if failure is not None:
            raise failure

    def take_load(self) -> np.ndarray:
        """[L, E] tokens routed to each logical expert by this rank's requests since the last call."""
        out = self.load.cpu().numpy().copy()
        self.load.zero_()
        return out

    def apply_placement(self, new: Placement) -> None:
        """Collective: every rank swaps to `new` at the same point between two steps, expert weights (FP8 with
        their scales) moved between ranks into the tensors the model holds, the routing tables rewritten in
        place (rebalance.py)."""
        layers = [expert_tensors(ex) for ex in self.experts]
        apply_placement(self.comm, self.placement, new, layers, self.routing)
        self.placement = new


def enable_expert_parallel(
    model: Any, placement: Placement, rank: int, dispatcher: Dispatcher, comm: Comm
) -> EPRuntime:
    """Hook every MoE layer of a model whose experts are already sharded (shard_experts / the rank loader)."""
    runtime = EPRuntime(model, placement, rank, dispatcher, comm)
    for j, (_, moe) in enumerate(runtime.layers):
        moe.ep = EPMoEHook(runtime, j)
    return runtime
