"""DeepSeek-V3's published config.json (671B), and narrower variants of it with fewer layers or experts:
the shapes GPU benchmarks and test checkpoints of V3 width are built from."""

from __future__ import annotations

import json
from typing import Any

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip


def deepseek_v3_config(**overrides: Any) -> dict[str, Any]:
    """DeepSeek-V3's config with overrides (e.g. num_hidden_layers=4, n_routed_experts=16); a key V3's config
    does not have is a ValueError."""
    unknown = sorted(set(overrides) - set(DEEPSEEK_V3))
    if unknown:
        raise ValueError(f"unknown DeepSeek-V3 config keys: {unknown}")
    config = json.loads(json.dumps(DEEPSEEK_V3)) | overrides
    if config["n_routed_experts"] % config["n_group"]:
        config["n_group"] = config["topk_group"] = 1
    return config
