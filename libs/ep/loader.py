"""Load one EP rank's model: every dense weight, but only the routed experts this rank's slots hold.

The model is built, its stacked experts are cut to the rank's S slots before any weight is read, and the
checkpoint is streamed: a routed expert's tensor is copied into each local slot holding that expert (two
slots when the rank holds two copies) and dropped otherwise. A missing tensor or unfilled slot is a
ValueError naming it, as in the single-rank loader.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from libs.engine.config import ModelConfig
from libs.engine.loader import _listing, iter_checkpoint_tensors, parse_dtype
from libs.engine.models.deepseek_v3 import CHECKPOINT_EXPERT_NAME, DeepseekV3ForCausalLM
from libs.ep.placement import Placement
from libs.ep.runtime import moe_layers, shard_experts

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PROJS = ("gate_proj", "up_proj", "down_proj")


def load_rank_model(
    path: str | Path,
    placement: Placement,
    rank: int,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> DeepseekV3ForCausalLM:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    cfg = ModelConfig.from_pretrained(folder)
    model = DeepseekV3ForCausalLM(cfg, parse_dtype(dtype), device)
    shard_experts(model, placement, rank, copy=False)
    moe_index = {layer_id: j for j, (layer_id, _) in enumerate(moe_layers(model))}
    local = placement.local_experts(rank).tolist()  # [L][S] logical expert per local slot
    dense = {n for n in model.checkpoint_weight_names() if not CHECKPOINT_EXPERT_NAME.match(n)}
    loaded: set[str] = set()
    filled: set[tuple[int, int, str]] = set()  # (MoE layer, local slot, projection)
    stacks = [moe.experts for _, moe in moe_layers(model)]
    for name, tensor in iter_checkpoint_tensors(folder, cfg):
        m = CHECKPOINT_EXPERT_NAME.match(name)
        if name in dense:
            model.load_weight(name, tensor)
            loaded.add(name)
            continue
        if _skippable(name, cfg):
            continue
        if m is None:
            raise ValueError(f"checkpoint {folder} has an unexpected tensor {name}")
        layer_id = int(_LAYER.match(name).group(1))  # type: ignore[union-attr]
        if layer_id not in moe_index:
            raise ValueError(f"checkpoint {folder}: {name} is an expert of a layer without routed experts")
        j, expert, proj = moe_index[layer_id], int(m.group(2)), m.group(3)
        for slot in (s for s, e in enumerate(local[j]) if e == expert):
            _slot_target(stacks[j], slot, proj, name, tensor).copy_(tensor)
            filled.add((j, slot, proj))
    _check_complete(folder, dense - loaded, filled, local)
    return model.eval()


def _slot_target(experts, slot: int, proj: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if proj == "down_proj":
        target = experts.down_proj.data[slot]
    else:
        gate_up = experts.gate_up_proj.data[slot]
        half = gate_up.shape[0] // 2
        target = gate_up[:half] if proj == "gate_proj" else gate_up[half:]
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
        )
    return target


def _check_complete(folder: Path, missing_dense: set[str], filled: set, local: list[list[int]]) -> None:
    missing = sorted(missing_dense)
    for j, experts in enumerate(local):
        for slot, expert in enumerate(experts):
            missing += [f"MoE layer {j} expert {expert} {p}" for p in PROJS if (j, slot, p) not in filled]
    if missing:
        raise ValueError(
            f"checkpoint {folder} is missing {len(missing)} tensors for this rank: {_listing(missing)}"
        )


def _skippable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a valid checkpoint may carry that the model does not use (MTP layers, rope buffers, tied head)."""
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return True
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers
