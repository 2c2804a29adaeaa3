"""Load one EP rank's model: every dense weight, but only the routed experts this rank's slots hold (each
copied into every local slot holding it, the rest dropped as the checkpoint streams). A missing tensor or
an unfilled slot is a ValueError naming it, as in the single-rank loader."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from libs.engine.config import ModelConfig
from libs.engine.layers.fp8_linear import apply_fp8_weights
from libs.engine.loader import (
    ReadStats,
    _listing,
    checkpoint_weight_map,
    iter_checkpoint_tensors,
    keeps_fp8,
    parse_dtype,
)
from libs.engine.models.deepseek_v3 import CHECKPOINT_EXPERT_NAME, DeepseekV3ForCausalLM
from libs.ep.placement import Placement
from libs.ep.runtime import moe_layers, shard_experts
from libs.quant.fp8 import SCALE_SUFFIX

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PROJS = ("gate_proj", "up_proj", "down_proj")


def load_rank_model(
    path: str | Path,
    placement: Placement,
    rank: int,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    quantization: str = "auto",
    stats: ReadStats | None = None,
) -> DeepseekV3ForCausalLM:
    """quantization as libs.engine.loader.load_model: an FP8 checkpoint's experts (and every other module
    that can) stay FP8 on CUDA with "auto", anywhere with "fp8"; "none" dequantizes. Only the rank's own
    tensors are read (and only the shards holding them opened); `stats` counts what was."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    cfg = ModelConfig.from_pretrained(folder)
    model = DeepseekV3ForCausalLM(cfg, parse_dtype(dtype), device)
    shard_experts(model, placement, rank, copy=False)
    keep = _keep_fp8(model, folder, cfg, quantization)
    moe_index = {layer_id: j for j, (layer_id, _) in enumerate(moe_layers(model))}
    local = placement.local_experts(rank).tolist()  # [L][S] logical expert per local slot
    dense = {n for n in model.checkpoint_weight_names() if not CHECKPOINT_EXPERT_NAME.match(n)}
    loaded: set[str] = set()
    filled: set[tuple[int, int, str]] = set()  # (MoE layer, local slot, projection)
    stacks = [moe.experts for _, moe in moe_layers(model)]
    mine = [set(experts) for experts in local]

    def wanted(name: str) -> bool:  # an unexpected name is read, so the error below can name it
        m = CHECKPOINT_EXPERT_NAME.match(name)
        if _skippable(name, cfg) or m is None:
            return not _skippable(name, cfg)
        j = moe_index.get(int(_LAYER.match(name).group(1)))  # type: ignore[union-attr]
        return j is None or int(m.group(2)) in mine[j]

    for name, tensor in iter_checkpoint_tensors(folder, cfg, keep_fp8=keep, wanted=wanted, stats=stats):
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
        j, expert, part = moe_index[layer_id], int(m.group(2)), m.group(3) + (m.group(4) or "")
        for slot in (s for s, e in enumerate(local[j]) if e == expert):
            _slot_target(stacks[j], slot, part, name, tensor).copy_(tensor)
            filled.add((j, slot, part))
    parts = PROJS + tuple(p + SCALE_SUFFIX for p in PROJS) if stacks and stacks[0].is_fp8 else PROJS
    _check_complete(folder, dense - loaded, filled, local, parts)
    return model.eval()


def _keep_fp8(model: DeepseekV3ForCausalLM, folder: Path, cfg: ModelConfig, quantization: str) -> set[str]:
    """Convert what can stay FP8 (experts: the rank's S slots) -> every checkpoint weight to load raw."""
    if not keeps_fp8(quantization, cfg, model.device):
        return set()
    assert cfg.fp8_block_size is not None
    weight_map = checkpoint_weight_map(folder)
    fp8_names = {n[: -len(SCALE_SUFFIX)] for n in weight_map if n.endswith(SCALE_SUFFIX)}
    keep = apply_fp8_weights(model, fp8_names, cfg.fp8_block_size)
    fp8_layers = {layer_id for layer_id, moe in moe_layers(model) if moe.experts.is_fp8}
    for name in fp8_names:  # every expert of a converted layer, not only the S whose names match a slot
        m = CHECKPOINT_EXPERT_NAME.match(name)
        if m is not None and int(_LAYER.match(name).group(1)) in fp8_layers:  # type: ignore[union-attr]
            keep.add(name)
    return keep


def _slot_target(experts, slot: int, part: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    proj, scale = part.removesuffix(SCALE_SUFFIX), SCALE_SUFFIX if part.endswith(SCALE_SUFFIX) else ""
    if proj == "down_proj":
        target = getattr(experts, "down_proj" + scale).data[slot]
    else:
        gate_up = getattr(experts, "gate_up_proj" + scale).data[slot]
        half = gate_up.shape[0] // 2
        target = gate_up[:half] if proj == "gate_proj" else gate_up[half:]
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
        )
    return target


def _check_complete(
    folder: Path, missing_dense: set[str], filled: set, local: list[list[int]], parts: tuple[str, ...]
) -> None:
    missing = sorted(missing_dense)
    for j, experts in enumerate(local):
        for slot, expert in enumerate(experts):
            missing += [f"MoE layer {j} expert {expert} {p}" for p in parts if (j, slot, p) not in filled]
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
