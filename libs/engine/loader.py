"""Load a Hugging Face checkpoint folder into DeepseekV3ForCausalLM: config.json, then the safetensors shards
(by the index, a single file, or every *.safetensors), cast to the model dtype or, for FP8 weights, kept FP8
or dequantized. Anything missing or unknown is a ValueError naming the tensors."""

# Kept FP8, the modules that can run them become FP8 modules (layers.fp8_linear) and weight and scale land
# by name. Skipped: the MTP layers DeepSeek appends after the last decoder layer, and legacy
# rotary_emb.inv_freq buffers.

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from libs.engine.config import ModelConfig
from libs.engine.layers.fp8_linear import apply_fp8_weights
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_fp8_block

log = logging.getLogger("moemesh.engine")

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip
_PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
QUANTIZATION_MODES = ("auto", "fp8", "none")


@dataclass
class ReadStats:
    """What a load read: the shards it opened, and the tensors and data bytes it took from them."""

    shards: set[Path] = field(default_factory=set)
    tensors: int = 0
    bytes: int = 0


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _PLAIN_DTYPES:
            raise ValueError(f"unsupported model dtype {dtype}: use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported model dtype {dtype!r}: use float32, bfloat16 or float16")
    return _DTYPES[dtype]


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantization: str = "auto",
) -> DeepseekV3ForCausalLM:
    """Build the model from `path`/config.json and fill every parameter from the folder's safetensors.
    quantization: "auto" keeps FP8 weights FP8 on CUDA and dequantizes them elsewhere; "fp8" keeps them on
    any device (CPU: Triton's interpreter or the torch reference, for tests); "none" dequantizes to `dtype`."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    cfg = ModelConfig.from_pretrained(folder)
    model = DeepseekV3ForCausalLM(cfg, parse_dtype(dtype), device)
    weight_map = checkpoint_weight_map(folder)
    keep: set[str] = set()
    if keeps_fp8(quantization, cfg, device):
        assert cfg.fp8_block_size is not None
        fp8_names = {n[: -len(SCALE_SUFFIX)] for n in weight_map if n.endswith(SCALE_SUFFIX)}
        keep = apply_fp8_weights(model, fp8_names, cfg.fp8_block_size)
        log.info("%s: %d of %d FP8 weights kept in FP8", folder.name, len(keep), len(fp8_names))
    expected = model.checkpoint_weight_names()
    loaded: set[str] = set()
    unexpected: list[str] = []
    tensors = iter_checkpoint_tensors(folder, cfg, progress=progress, keep_fp8=keep, weight_map=weight_map)
    for name, tensor in tensors:
        if name not in expected:
            if not _skippable(name, cfg):
                unexpected.append(name)
            continue
        model.load_weight(name, tensor)
        loaded.add(name)
    if unexpected:
        raise ValueError(
            f"checkpoint {folder} has {len(unexpected)} unexpected tensors: {_listing(unexpected)}"
        )
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {folder} is missing {len(missing)} tensors: {_listing(missing)}")
    return model.eval()


def keeps_fp8(quantization: str, cfg: ModelConfig, device: str | torch.device) -> bool:
    """Whether an FP8 checkpoint's weights stay FP8 (see load_model); "fp8" without one is an error."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    if quantization == "none":
        return False
    if cfg.fp8_block_size is None:
        if quantization == "fp8":
            raise ValueError("quantization='fp8' needs an FP8 checkpoint (config.json quantization_config)")
        return False
    return quantization == "fp8" or torch.device(device).type == "cuda"


def checkpoint_weight_map(folder: Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index when there is one, else from the shards' headers."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = {f: folder / f for f in set(weight_map.values())}
        absent = sorted(f for f, p in files.items() if not p.is_file())
        if absent:
            raise ValueError(f"{index} lists shards that are not in the folder: {_listing(absent)}")
        return {name: files[f] for name, f in weight_map.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no safetensors weights in {folder} (expected {INDEX_FILE} or *.safetensors)")
    result: dict[str, Path] = {}
    for shard in shards:
        with _open(shard) as f:
            result.update({name: shard for name in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return result


def iter_checkpoint_tensors(
    folder: Path,
    cfg: ModelConfig,
    progress: bool = False,
    keep_fp8: Collection[str] = (),
    weight_map: dict[str, Path] | None = None,
    wanted: Callable[[str], bool] | None = None,
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor (or those `wanted` accepts: no other is read, and a
    shard holding none of them is never opened), fp8 weights already dequantized to float32, except the
    weights named in `keep_fp8`: those come raw (float8_e4m3fn), each followed by its `_scale_inv`."""
    weight_map = weight_map if weight_map is not None else checkpoint_weight_map(folder)
    block = cfg.fp8_block_size or (128, 128)
    names = [n for n in weight_map if not n.endswith(SCALE_SUFFIX) and (wanted is None or wanted(n))]
    orphans = sorted(
        n for n in weight_map if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in weight_map
    )
    if orphans:
        raise ValueError(f"FP8 scales without a weight: {_listing(orphans)}")
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get(name: str) -> torch.Tensor:
            shard = weight_map[name]
            if shard not in handles:
                handles[shard] = stack.enter_context(_open(shard))
            try:
                tensor = handles[shard].get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"cannot read tensor {name} from {shard}: {e}") from e
            if stats is not None:
                stats.shards.add(shard)
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
            return tensor

        for name in tqdm(
            sorted(names, key=_shard_order(weight_map)), desc="loading", unit="tensor", disable=not progress
        ):
            tensor = get(name)
            if name in keep_fp8:
                if tensor.dtype != FP8_DTYPE:
                    raise ValueError(f"tensor {name} has a {SCALE_SUFFIX} but dtype {tensor.dtype}, not FP8")
                yield name, tensor
                yield name + SCALE_SUFFIX, get(name + SCALE_SUFFIX)
                continue
            if tensor.dtype == FP8_DTYPE:
                scale_name = name + SCALE_SUFFIX
                if scale_name not in weight_map:
                    raise ValueError(f"FP8 tensor {name} has no {scale_name}")
                try:
                    tensor = dequantize_fp8_block(tensor, get(scale_name), block)
                except ValueError as e:
                    raise ValueError(f"tensor {name}: {e}") from e
            elif tensor.dtype not in _PLAIN_DTYPES:
                raise ValueError(f"tensor {name} has unsupported dtype {tensor.dtype}")
            yield name, tensor


def _shard_order(weight_map: dict[str, Path]):
    return lambda name: (str(weight_map[name]), name)


def _open(shard: Path):
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"cannot open safetensors shard {shard}: {e}") from e


def _skippable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a valid checkpoint may carry that this model does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True
    m = _LAYER.match(name)
    mtp_end = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return m is not None and cfg.num_hidden_layers <= int(m.group(1)) < mtp_end


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
