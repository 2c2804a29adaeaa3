"""Checkpoints in DeepSeek-V3's released layout at a reduced width (`moemesh tiny-model --preset v3-layout`): the
release's tensor names, dtypes, shard files and tensor-to-shard placement, with only the widths shrunk, so a
loader meets the real files and tensor counts (docs/gpu.md, "Serving DeepSeek-V3 for real")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from libs.engine.models.deepseek_v3 import CHECKPOINT_EXPERT_NAME
from libs.engine.presets import deepseek_v3_config
from libs.engine.tiny import is_fp8_weight, weight_shapes, write_folder_files
from libs.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX
from libs.tokenizer.build import VOCAB_SIZE

SHARDS = 163
BLOCK = 128
# the reduced widths (DeepSeek-V3's in comments); every other config.json value is V3's
NARROW: dict[str, Any] = {
    "hidden_size": 64,  # 7168
    "intermediate_size": 128,  # 18432
    "moe_intermediate_size": 16,  # 2048
    "q_lora_rank": 32,  # 1536
    "kv_lora_rank": 32,  # 512
    "qk_nope_head_dim": 16,  # 128
    "qk_rope_head_dim": 16,  # 64
    "v_head_dim": 16,  # 128
    "num_attention_heads": 2,  # 128
    "num_key_value_heads": 2,  # 128
    "vocab_size": VOCAB_SIZE,  # 129280
    "max_position_embeddings": 4096,  # 163840
}


def layout_config(layers: int = 61, **overrides: Any) -> dict[str, Any]:
    """DeepSeek-V3's config.json at NARROW widths with `layers` decoder layers (the MTP layer follows them)."""
    return deepseek_v3_config(**{**NARROW, "num_hidden_layers": layers, **overrides})


def is_fp8(name: str) -> bool:
    """Stored FP8 in DeepSeek-V3's release: every projection but the MTP module's eh_proj."""
    return is_fp8_weight(name) and not name.endswith("eh_proj.weight")


def tensor_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a weight as the release stores it, its block scales included."""
    n = math.prod(shape)
    if is_fp8(name):
        return n + 4 * math.ceil(shape[0] / BLOCK) * math.ceil(shape[-1] / BLOCK)
    return 4 * n if name.endswith("e_score_correction_bias") else 2 * n


def file_order(config: dict[str, Any]) -> list[str]:
    """Weight names in DeepSeek's file order: embeddings, layers 0..L-1, lm_head and norm, the MTP layer."""
    names = list(weight_shapes(config))
    mtp = f"model.layers.{config['num_hidden_layers']}."
    head = [n for n in names if n in ("lm_head.weight", "model.norm.weight")]
    body = [n for n in names if n not in head and not n.startswith(mtp)]
    return body + head + [n for n in names if n.startswith(mtp)]


def shard_plan(config: dict[str, Any], shards: int = SHARDS) -> dict[str, int]:
    """Weight name -> shard index (0-based): cut at equal shares of the full-size model's bytes in file order,
    so a tensor lands where its counterpart in DeepSeek's 163 files does (a scale always beside its weight)."""
    full = weight_shapes(deepseek_v3_config(num_hidden_layers=config["num_hidden_layers"]))
    order = file_order(config)
    sizes = [tensor_bytes(n, full[n]) for n in order]
    total, seen, plan = sum(sizes), 0, {}
    for name, size in zip(order, sizes, strict=True):
        plan[name] = min(shards - 1, seen * shards // total)
        seen += size
    return plan


def shard_name(i: int, shards: int = SHARDS) -> str:
    return f"model-{i + 1:05d}-of-{shards:06d}.safetensors"


def _scaled_fp8(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights [..., O, K] and their float32 block scales, drawn as one stack: unit-normal FP8 codes
    picked from a drawn pool (casting every element to FP8 on the CPU costs seconds per model)."""
    o, k = shape[-2:]
    scale = 1 + 0.1 * torch.rand((*shape[:-2], math.ceil(o / BLOCK), math.ceil(k / BLOCK)), generator=gen)
    pool = torch.randn(4096, generator=gen).to(FP8_DTYPE).view(torch.uint8)
    codes = pool[torch.randint(0, len(pool), shape, generator=gen)]
    return codes.view(FP8_DTYPE), scale / math.sqrt(k)


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> dict[str, torch.Tensor]:
    k = shape[-1]
    if is_fp8(name):
        w, scale = _scaled_fp8(shape, gen)
        return {name: w, name + SCALE_SUFFIX: scale}
    if name.endswith("e_score_correction_bias"):
        t = 0.01 * torch.randn(shape, generator=gen)
    elif name.endswith("norm.weight"):
        t = 1 + 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen)
    elif name.endswith("head.weight"):  # lm_head and the MTP's shared head: logit std ~2
        t = 2 * torch.randn(shape, generator=gen) / math.sqrt(k)
    else:  # the router and eh_proj
        t = torch.randn(shape, generator=gen) / math.sqrt(k)
    return {name: t if name.endswith("e_score_correction_bias") else t.bfloat16()}


class _Experts:
    """A layer's routed experts drawn one stack per projection (not 768 small draws), handed out by name."""

    def __init__(self, config: dict[str, Any], gen: torch.Generator) -> None:
        self.n, self.gen = config["n_routed_experts"], gen
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        m = CHECKPOINT_EXPERT_NAME.match(name)
        if m is None:
            return None
        layer, expert, proj = int(name.split(".")[2]), int(m.group(2)), m.group(3)
        if (layer, proj) not in self.stacks:
            self.stacks = {k: v for k, v in self.stacks.items() if k[0] == layer}  # earlier layers are done
            self.stacks[layer, proj] = _scaled_fp8((self.n, *shape), self.gen)
        w, scale = self.stacks[layer, proj]
        return {name: w[expert], name + SCALE_SUFFIX: scale[expert]}


def write_layout_model(
    out_dir: str | Path, *, layers: int = 61, seed: int = 0, overwrite: bool = False, shards: int = SHARDS
) -> Path:
    """Write the folder (module docstring) and return its path; `layers` < 61 keeps the names and shard
    rule with fewer layers (for tests that run a forward). A non-empty out_dir is refused unless overwrite."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; choose a new folder or pass overwrite=True (--force)")
    config = layout_config(layers)
    shapes, plan = weight_shapes(config), shard_plan(config, shards)
    gen = torch.Generator().manual_seed(seed)
    experts = _Experts(config, gen)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total, current = 0, 0
    batch: dict[str, torch.Tensor] = {}
    for name in file_order(config):
        if plan[name] != current:
            total += write_shard(out, shard_name(current, shards), batch, weight_map)
            current, batch = plan[name], {}
        batch.update(experts.take(name, shapes[name]) or _draw(name, shapes[name], gen))
    total += write_shard(out, shard_name(current, shards), batch, weight_map)
    write_folder_files(out, config, weight_map, total)
    return out


_CODES = {FP8_DTYPE: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32"}


def write_shard(out: Path, file: str, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]) -> int:
    """One safetensors file (the format's header + raw little-endian data, 8-byte aligned), written directly:
    safetensors' save_file spends ~100 us of Python per tensor, minutes over 91,991 tensors."""
    if not tensors:
        return 0
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(out / file, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().data)
    weight_map.update(dict.fromkeys(tensors, file))
    return offset
