"""Model configuration read from a Hugging Face `config.json` (DeepSeek-V3 / V2 / V2-Lite architecture), with
everything the engine needs resolved once (gate flavour, which layers are MoE, YaRN RoPE numbers, softmax
scale), so the model code never looks at raw JSON."""

# Accepts DeepSeek's own files (model_type deepseek_v3 / deepseek_v2, `rope_scaling` with a `type` key and
# `rope_theta` beside it) and newer transformers' (`rope_parameters` with `rope_type` and `rope_theta` inside).

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
_TOPK_METHODS = {"noaux_tc": "sigmoid", "greedy": "softmax", "group_limited_greedy": "softmax"}


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention-temperature correction (DeepSeek's `yarn_get_mscale`)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the `qk_rope_head_dim` part of each head ("default" or "yarn")."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin scale; derived from mscale values when None
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """Scale YaRN applies to cos/sin (DeepSeek's `_mscale`); 1 for plain RoPE."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)


@dataclass(frozen=True)
class ModelConfig:
    """The HF config fields of a DeepSeek-V3-architecture model, validated and with derived values."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    q_lora_rank: int | None = None  # None: plain q_proj (DeepSeek-V2-Lite)
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0  # 0: every layer is dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    fp8_block_size: tuple[int, int] | None = None  # set when config.json declares DeepSeek's fp8 quantization
    torch_dtype: str | None = None

    # --- derived ---
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Values per token per layer in the latent KV cache: normalized c_kv then roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's correction)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def v3_weighting(self) -> bool:
        """V3 gates always multiply by routed_scaling_factor; V2 gates do it only when not renormalizing."""
        return self.scoring_func == "sigmoid"

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    # --- construction ---
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json` (or `path` itself when it is a file)."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"no config.json found at {p}")
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot parse {file}: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{file} does not hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: moemesh serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        is_v3 = model_type == "deepseek_v3"
        topk_method = raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
        if topk_method not in _TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {topk_method!r} (known: {', '.join(_TOPK_METHODS)})")
        scoring_func = raw.get("scoring_func") or _TOPK_METHODS[topk_method]
        if scoring_func != _TOPK_METHODS[topk_method]:
            raise ValueError(f"topk_method {topk_method!r} needs scoring_func {_TOPK_METHODS[topk_method]!r}")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: DeepSeek models use silu")
        n_routed = raw.get("n_routed_experts") or 0
        grouped = topk_method != "greedy"
        cfg = cls(
            model_type=model_type,
            vocab_size=_req_int(raw, "vocab_size"),
            hidden_size=_req_int(raw, "hidden_size"),
            intermediate_size=_req_int(raw, "intermediate_size"),
            num_hidden_layers=_req_int(raw, "num_hidden_layers"),
            num_attention_heads=_req_int(raw, "num_attention_heads"),
            kv_lora_rank=_req_int(raw, "kv_lora_rank"),
            qk_nope_head_dim=_req_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_req_int(raw, "qk_rope_head_dim"),
            v_head_dim=_req_int(raw, "v_head_dim"),
            max_position_embeddings=_req_int(raw, "max_position_embeddings"),
            q_lora_rank=raw.get("q_lora_rank"),
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            n_routed_experts=n_routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            n_group=(raw.get("n_group") or 1) if grouped else 1,
            topk_group=(raw.get("topk_group") or 1) if grouped else 1,
            topk_method=topk_method,
            scoring_func=scoring_func,
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope=_rope_from_raw(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
            fp8_block_size=_fp8_block_size(raw.get("quantization_config")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank"):
            _positive(name, getattr(self, name))
        for name in ("qk_nope_head_dim", "v_head_dim", "max_position_embeddings", "intermediate_size"):
            _positive(name, getattr(self, name))
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be a positive even number, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.first_k_dense_replace < 0 or self.moe_layer_freq < 1:
            raise ValueError("first_k_dense_replace must be >= 0 and moe_layer_freq >= 1")
        if self.n_routed_experts:
            self._validate_moe()

    def _validate_moe(self) -> None:
        _positive("moe_intermediate_size", self.moe_intermediate_size)
        k, e, g = self.num_experts_per_tok, self.n_routed_experts, self.n_group
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={e}], got {k}")
        if g < 1 or e % g:
            raise ValueError(f"n_routed_experts ({e}) must be divisible by n_group ({g})")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"topk_group must be in [1, n_group={g}], got {self.topk_group}")
        if k > self.topk_group * (e // g):
            raise ValueError(f"num_experts_per_tok ({k}) exceeds the experts in topk_group groups")
        if self.topk_method == "noaux_tc" and e // g < 2:
            raise ValueError("noaux_tc scores a group by its top-2 experts: need >= 2 experts per group")


def _req_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config.json: {key!r} must be an integer, got {value!r}")
    return value


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"config.json: {name} must be positive, got {value}")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_raw(raw: dict[str, Any]) -> RopeConfig:
    """Merge DeepSeek's `rope_scaling` + `rope_theta` and transformers' `rope_parameters` into RopeConfig."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "yarn":
        raise ValueError(f"unsupported RoPE type {rope_type!r}: DeepSeek models use 'yarn' or plain RoPE")
    max_pos = raw.get("max_position_embeddings", 4096)
    orig = int(params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / orig
    if factor <= 0:
        raise ValueError(f"RoPE factor must be positive, got {factor}")
    attn_factor = params.get("attention_factor")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params["mscale"]) if params.get("mscale") is not None else 1.0,
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=float(attn_factor) if attn_factor is not None else None,
        truncate=bool(params.get("truncate", True)),
    )


def _fp8_block_size(qcfg: Any) -> tuple[int, int] | None:
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported quantization {method!r}: only DeepSeek's block fp8 loads")
    block = qcfg.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])
