"""Random checkpoints of DeepSeek-V3's width (libs.engine.presets) with fewer layers and experts, for GPU tests
and benchmarks of the whole mesh: the real MLA dims and vocabulary, FP8 e4m3 projections with 128x128 block
scales, bf16 embeddings, norms and router, float32 e_score_correction_bias, as DeepSeek's own folders hold."""

# Fast to write: every tensor is drawn on `device` with torch's generator, one safetensors shard per decoder
# layer (host memory holds one layer at a time). Scales as random_weights.fill_random_. The tokenizer is
# libs.tokenizer.build's tiny byte-level BPE: ids past it are model padding (DeepSeek's own vocabulary is
# wider than its tokenizer too), so random weights may emit ids that decode to nothing.

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from libs.engine.presets import deepseek_v3_config
from libs.engine.tiny import is_fp8_weight, weight_shapes, write_folder_files
from libs.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX

PRESETS = ("v3-width",)
BLOCK = 128


def preset_config(
    preset: str = "v3-width", *, layers: int = 4, experts: int = 16, top_k: int = 8, dense_layers: int = 1,
    **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """DeepSeek-V3's config.json with `layers` decoder layers (the first `dense_layers` dense), `experts`
    routed experts and top-`top_k` routing, no MTP layer; `overrides` are other config.json keys."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if layers < 1 or not 0 <= dense_layers <= layers:
        raise ValueError(f"need layers >= 1 and 0 <= dense_layers <= layers, got {layers}, {dense_layers}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"need 1 <= top_k <= experts, got top_k {top_k}, experts {experts}")
    config = deepseek_v3_config(
        num_hidden_layers=layers, n_routed_experts=experts, num_experts_per_tok=top_k,
        first_k_dense_replace=dense_layers, num_nextn_predict_layers=0, **overrides,
    )  # fmt: skip
    reachable = config["topk_group"] * experts // config["n_group"]
    if top_k > reachable:  # group-limited routing picks top_k among topk_group groups' experts
        raise ValueError(
            f"top_k {top_k} exceeds the {reachable} experts of topk_group {config['topk_group']} of "
            f"n_group {config['n_group']} groups; pass n_group/topk_group overrides"
        )
    return config


def _shard_key(name: str) -> str:
    if name.startswith("model.layers."):
        return f"layer-{int(name.split('.')[2]):04d}"
    return "embed" if name.startswith("model.embed_tokens.") else "head"


def _shards(config: dict[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Tensor shapes grouped by shard (embeddings, one per decoder layer, final norm + lm_head), in order."""
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in weight_shapes(config).items():
        out.setdefault(_shard_key(name), {})[name] = shape
    return out


def _random_tensors(
    shapes: dict[str, tuple[int, ...]], gen: torch.Generator, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    def randn(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    for name, shape in shapes.items():
        k = shape[-1]
        if is_fp8_weight(name):
            yield name, randn(shape).to(FP8_DTYPE)
            blocks = (math.ceil(shape[0] / BLOCK), math.ceil(k / BLOCK))
            scale = 1 + 0.1 * torch.rand(blocks, generator=gen, device=device)
            yield name + SCALE_SUFFIX, scale / math.sqrt(k)
        elif name.endswith("norm.weight"):
            yield name, 1 + 0.1 * randn(shape)
        elif name.endswith("e_score_correction_bias"):
            yield name, 0.01 * randn(shape, torch.float32)
        elif name == "model.embed_tokens.weight":
            yield name, randn(shape)
        elif name == "lm_head.weight":  # logit std ~2, as libs.engine.tiny's
            yield name, randn(shape).mul_(2 / math.sqrt(k))
        else:  # the router
            yield name, randn(shape).mul_(1 / math.sqrt(k))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def write_preset_model(
    out_dir: str | Path, preset: str = "v3-width", *, layers: int = 4, experts: int = 16, top_k: int = 8,
    dense_layers: int = 1, seed: int = 0, device: str | torch.device | None = None, overwrite: bool = False,
    **overrides: Any,
) -> Path:  # fmt: skip
    """Write the checkpoint folder (module docstring) and return its path; a non-empty out_dir is refused
    unless overwrite. The same seed and device give the same tensors."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; choose a new folder or pass overwrite=True (--force)")
    config = preset_config(
        preset, layers=layers, experts=experts, top_k=top_k, dense_layers=dense_layers, **overrides
    )
    dev = torch.device(device) if device is not None else default_device()
    gen = torch.Generator(device=dev).manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(config)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shapes in enumerate(shards.values()):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: t.cpu() for n, t in _random_tensors(shapes, gen, dev)}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    write_folder_files(out, config, weight_map, total)
    return out
