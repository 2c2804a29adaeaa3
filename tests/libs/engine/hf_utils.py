"""Random tiny DeepSeek checkpoints written by transformers, and transformers' model as the oracle.

`make_hf_checkpoint(dir, seed, **overrides)` builds `DeepseekV3Config` (or `DeepseekV2Config` with
`arch="deepseek_v2"`) from TINY_V3 plus overrides, initializes `DeepseekV3ForCausalLM` from the seed, gives
every MoE gate a random `e_score_correction_bias` (std `bias_std`, so selection-only bias is exercised),
and saves it with `save_pretrained` plus the tiny tokenizer. `hf_model(path)` loads it back in fp32 eval
mode with eager attention. Everything is local and deterministic in the seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from libs.tokenizer.build import VOCAB_SIZE, build_tokenizer

TINY_V3: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def _classes(arch: str):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if arch == "deepseek_v3":
        return DeepseekV3Config, DeepseekV3ForCausalLM
    if arch == "deepseek_v2":
        return DeepseekV2Config, DeepseekV2ForCausalLM
    raise ValueError(f"unknown arch {arch!r}")


def make_hf_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    arch: str = "deepseek_v3",
    bias_std: float = 0.1,
    **config_overrides: Any,
) -> Path:
    """Write a random checkpoint folder (config.json, model.safetensors, tokenizer files); return its path."""
    config_cls, model_cls = _classes(arch)
    kwargs = {**TINY_V3, **config_overrides}
    if arch == "deepseek_v2":
        kwargs.setdefault("topk_method", "greedy")
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * bias_std)
    out = Path(out_dir)
    model.save_pretrained(out)
    build_tokenizer(out, model_max_length=config.max_position_embeddings)
    return out


def hf_model(path: str | Path):
    """transformers' model for the checkpoint at `path`, fp32, eval mode, eager attention."""
    raw = json.loads((Path(path) / "config.json").read_text())
    _, model_cls = _classes(raw["model_type"])
    model = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def rewrite_config(path: str | Path, **changes: Any) -> None:
    """Edit config.json in place (None deletes a key): e.g. to write DeepSeek's own `rope_scaling` form."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    file.write_text(json.dumps(raw, indent=2))
