"""Random DeepSeek-V3-architecture checkpoint folders, written locally, for tests and the embedded default,
laid out as DeepSeek's own (config.json in its field names, two shards with an index, one tensor per expert,
the tiny tokenizer); fp8=True stores linears as DeepSeek-V3 ships them. Same seed, same tensors either way."""

# FP8: float8_e4m3fn plus float32 `<name>_scale_inv` per 128x128 block (embeddings, norms, router and lm_head
# stay float32), so a test can check the fp8 folder against the float one. The init makes a usable toy:
# unit-variance embeddings and fan-in scaled linears keep activations O(1), and noise on norms and router
# bias spreads logits and makes routing matter.

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from libs.quant.fp8 import quantize_fp8_block
from libs.tokenizer.build import VOCAB_SIZE, build_tokenizer

FP8_BLOCK = (128, 128)
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}
SHARD_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")

# DeepSeek-V3's config.json, shrunk (same keys and conventions; vocab = the tiny tokenizer's).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "kv_lora_rank": 32,
    "max_position_embeddings": 4096,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 64,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "torch_dtype": "float32",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": VOCAB_SIZE,
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """TINY_CONFIG with overrides (DeepSeek's config.json keys only; a typo is a ValueError)."""
    unknown = sorted(set(overrides) - set(TINY_CONFIG) - {"rope_interleave", "quantization_config"})
    if unknown:
        raise ValueError(f"unknown config keys for a tiny model: {unknown}")
    config = json.loads(json.dumps(TINY_CONFIG)) | overrides
    if config["model_type"] not in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
        raise ValueError(
            f"tiny models are DeepSeek-V2/V3 architecture, not model_type {config['model_type']!r}"
        )
    if "architectures" not in overrides and config["model_type"] == "deepseek_v2":
        config["architectures"] = ["DeepseekV2ForCausalLM"]
    if config["vocab_size"] < VOCAB_SIZE:
        raise ValueError(f"vocab_size {config['vocab_size']} is smaller than the tokenizer's {VOCAB_SIZE}")
    if config["n_routed_experts"] % config["n_group"] or config["topk_group"] > config["n_group"]:
        raise ValueError("n_routed_experts must divide into n_group groups, and topk_group <= n_group")
    return config


def is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """DeepSeek's rule for which decoder layers have routed experts instead of a dense MLP."""
    return layer >= config["first_k_dense_replace"] and layer % config.get("moe_layer_freq", 1) == 0


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def _attention_shapes(c: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {}
    if c["q_lora_rank"]:
        shapes[f"{p}.q_a_proj.weight"] = (c["q_lora_rank"], d)
        shapes[f"{p}.q_a_layernorm.weight"] = (c["q_lora_rank"],)
        shapes[f"{p}.q_b_proj.weight"] = (h * qk_head, c["q_lora_rank"])
    else:  # DeepSeek-V2-Lite: no q low-rank path
        shapes[f"{p}.q_proj.weight"] = (h * qk_head, d)
    shapes[f"{p}.kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], d)
    shapes[f"{p}.kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
    shapes[f"{p}.kv_b_proj.weight"] = (h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    shapes[f"{p}.o_proj.weight"] = (d, h * c["v_head_dim"])
    return shapes


def _layer_shapes(c: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    d, p = c["hidden_size"], f"model.layers.{i}"
    shapes: dict[str, tuple[int, ...]] = {f"{p}.input_layernorm.weight": (d,)}
    shapes.update(_attention_shapes(c, f"{p}.self_attn"))
    shapes[f"{p}.post_attention_layernorm.weight"] = (d,)
    if not is_moe_layer(c, i):
        return shapes | _mlp_shapes(f"{p}.mlp", d, c["intermediate_size"])
    shapes[f"{p}.mlp.gate.weight"] = (c["n_routed_experts"], d)
    if c["topk_method"] == "noaux_tc":
        shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (c["n_routed_experts"],)
    for e in range(c["n_routed_experts"]):
        shapes.update(_mlp_shapes(f"{p}.mlp.experts.{e}", d, c["moe_intermediate_size"]))
    if c["n_shared_experts"]:
        inter = c["moe_intermediate_size"] * c["n_shared_experts"]
        shapes.update(_mlp_shapes(f"{p}.mlp.shared_experts", d, inter))
    return shapes


def _mtp_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's MTP module as layer num_hidden_layers: a decoder block plus its own norms,
    eh_proj, embedding copy and shared head."""
    d, i, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    p = f"model.layers.{i}"
    return _layer_shapes(c, i) | {
        f"{p}.enorm.weight": (d,),
        f"{p}.hnorm.weight": (d,),
        f"{p}.eh_proj.weight": (d, 2 * d),
        f"{p}.embed_tokens.weight": (v, d),
        f"{p}.shared_head.norm.weight": (d,),
        f"{p}.shared_head.head.weight": (v, d),
    }


def weight_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, in transformers' DeepseekV3 names and file order
    (the MTP module last, when num_nextn_predict_layers is 1)."""
    d = c["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        shapes.update(_layer_shapes(c, i))
    shapes["model.norm.weight"] = (d,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], d)
    if c.get("num_nextn_predict_layers"):
        shapes.update(_mtp_shapes(c))
    return shapes


def is_fp8_weight(name: str) -> bool:
    """The tensors DeepSeek-V3 stores in FP8: attention and MLP/expert projections, nothing else."""
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def random_weights(c: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """float32 tensors for weight_shapes(c), deterministic in seed (see the module docstring for scales)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(c).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith("e_score_correction_bias"):
            out[name] = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            out[name] = noise
        elif name == "lm_head.weight":  # logit std ~2: a top token of 5-15%, neither flat nor one-hot
            out[name] = 2.0 * noise / math.sqrt(shape[-1])
        else:  # every projection and the router: fan-in scaling keeps outputs O(1)
            out[name] = noise / math.sqrt(shape[-1])
    return out


def _quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_fp8_weight(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t, FP8_BLOCK)
        else:
            out[name] = t
    return out


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, str]:
    """Two shards split between layers (a weight and its scale always together); their weight map."""
    first_half = (num_layers + 1) // 2

    def shard_of(name: str) -> int:
        parts = name.split(".")
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith("model.layers."):
            return 0 if int(parts[2]) < first_half else 1
        return 1

    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in tensors.items():
        shards[shard_of(name)][name] = t.contiguous()
    weight_map: dict[str, str] = {}
    for file, shard in zip(SHARD_NAMES, shards, strict=True):
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    return weight_map


def write_folder_files(out: Path, config: dict[str, Any], weight_map: dict[str, str], total: int) -> None:
    """Everything but the shards: the index over them (`weight_map`, `total` bytes), config.json,
    generation_config.json and the tokenizer."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    build_tokenizer(out, model_max_length=config["max_position_embeddings"])


def write_tiny_model(
    out_dir: str | Path, seed: int = 0, fp8: bool = False, *, overwrite: bool = False, **config_overrides: Any
) -> Path:
    """Write a random DeepSeek-V3-architecture checkpoint folder into out_dir and return its path.
    config_overrides are config.json keys (e.g. n_group=2, q_lora_rank=None, rope_scaling=None). A non-empty
    out_dir is refused unless overwrite=True (then the same file names are replaced)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; choose a new folder or pass overwrite=True (--force)")
    config = tiny_config(**config_overrides)
    tensors = random_weights(config, seed)
    if fp8:
        tensors = _quantize(tensors)
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = _write_shards(out, tensors, config["num_hidden_layers"])
    write_folder_files(out, config, weight_map, sum(t.numel() * t.element_size() for t in tensors.values()))
    return out
