"""ModelConfig: both RoPE spellings, V2/V3 defaults, derived numbers checked against transformers, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.layers.rope import RotaryEmbedding, yarn_inv_freq
from tests.libs.engine.hf_utils import TINY_V3, make_hf_checkpoint, rewrite_config

# DeepSeek-V3's own config.json (the fields that matter here), as shipped with the FP8 weights.
DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip

DEEPSEEK_V2_LITE_CONFIG = {
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "n_shared_experts": 2,
    "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "max_position_embeddings": 163840, "rope_theta": 10000, "eos_token_id": 100001,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


def test_deepseek_v3_shipped_config() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V3_CONFIG)
    assert cfg.kv_row_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40 and cfg.rope.cos_sin_scale == 1.0
    mscale = 0.1 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale)
    assert cfg.fp8_block_size == (128, 128) and cfg.eos_token_id == 1
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_deepseek_v2_lite_config() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V2_LITE_CONFIG)
    assert cfg.q_lora_rank is None and cfg.scoring_func == "softmax" and cfg.topk_method == "greedy"
    assert not cfg.norm_topk_prob and cfg.fp8_block_size is None
    # mscale == mscale_all_dim: the cos/sin correction cancels, the softmax one stays
    assert cfg.rope.cos_sin_scale == pytest.approx(1.0)
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * m * m)


def test_rope_scaling_and_rope_parameters_spellings_agree(tmp_path) -> None:
    path = make_hf_checkpoint(tmp_path, seed=0)
    new_style = ModelConfig.from_pretrained(path)
    params = dict(TINY_V3["rope_parameters"])
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    rewrite_config(path, rope_parameters=None, rope_scaling=params, rope_theta=theta)
    assert "rope_parameters" not in json.loads((path / "config.json").read_text())
    assert ModelConfig.from_pretrained(path) == new_style
    assert new_style.rope.factor == 4.0 and new_style.rope.original_max_position_embeddings == 128


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 5000.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 100,
         "mscale": 0.707, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    ],
)  # fmt: skip
def test_rope_and_softmax_scale_match_transformers(rope: dict) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    hf_cfg = DeepseekV3Config(**{**TINY_V3, "rope_parameters": rope})
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    hf_rope = DeepseekV3RotaryEmbedding(hf_cfg)
    torch.testing.assert_close(
        yarn_inv_freq(cfg.rope, cfg.qk_rope_head_dim), hf_rope.inv_freq, rtol=0, atol=0
    )
    assert cfg.rope.cos_sin_scale == pytest.approx(hf_rope.attention_scaling)
    assert cfg.softmax_scale == pytest.approx(DeepseekV3Attention(hf_cfg, 0).scaling)
    positions = torch.arange(0, 300, 7)
    x = torch.ones(len(positions), 1)
    hf_cos, hf_sin = hf_rope(x, positions[None])
    cos, sin = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, True).cos_sin(positions)
    half = cfg.qk_rope_head_dim // 2
    torch.testing.assert_close(cos, hf_cos[0, :, :half])
    torch.testing.assert_close(sin, hf_sin[0, :, :half])


def test_group_fields_ignored_for_greedy_gate() -> None:
    cfg = ModelConfig.from_dict({**DEEPSEEK_V2_LITE_CONFIG, "n_group": None, "topk_group": None})
    assert (cfg.n_group, cfg.topk_group) == (1, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"model_type": None}, "unsupported model_type None"),
        ({"vocab_size": None}, "'vocab_size' must be an integer"),
        ({"hidden_size": "7168"}, "'hidden_size' must be an integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be positive"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be a positive even number"),
        ({"topk_method": "top1"}, "unsupported topk_method 'top1'"),
        ({"scoring_func": "softmax"}, "needs scoring_func 'sigmoid'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"n_group": 7}, "must be divisible by n_group"),
        ({"topk_group": 9}, "topk_group must be in"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be in"),
        ({"n_group": 128, "topk_group": 1}, "exceeds the experts in topk_group groups"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported RoPE type 'linear'"),
        ({"quantization_config": {"quant_method": "awq"}}, "unsupported quantization 'awq'"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ],
)
def test_bad_config_names_the_problem(change: dict, message: str) -> None:
    raw = {**DEEPSEEK_V3_CONFIG, **change}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_dict(raw)


def test_bad_config_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        ModelConfig.from_pretrained(tmp_path)
