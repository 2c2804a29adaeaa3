"""A trainable DeepSeek-V3 (plain torch, autograd) whose parameters carry the checkpoint's names."""

# The serving model (libs/engine/models/deepseek_v3.py) is inference-only (paged KV, no autograd), so
# training uses this compact twin over whole sequences: the same MLA math in expanded form, the engine's
# own YaRN RoPE (`RotaryEmbedding`) and noaux_tc gate (`select_experts`), routed experts stacked per layer,
# shared experts, and one MTP module (DeepSeek-V3's multi-token prediction: enorm, hnorm, eh_proj, one
# decoder block, shared_head) that predicts token i+2 from the main model's final hidden state at i and
# the embedding of token i+1. `state_dict_hf()` returns the tensors under DeepSeek's checkpoint names
# (experts one tensor each, the MTP module as layer `num_hidden_layers`), which the engine's loader and
# transformers both read.
#
# Legend: B batch, T tokens, D hidden, H heads, N qk_nope_head_dim, r qk_rope_head_dim, R kv_lora_rank,
# V v_head_dim, E routed experts, I moe_intermediate_size, K experts per token.

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libs.engine.config import ModelConfig
from libs.engine.layers.rope import RotaryEmbedding
from libs.engine.layers.router import select_experts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _linear(d_in: int, d_out: int) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=d_in**-0.5)
    return layer


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        assert cfg.q_lora_rank is not None, "the demo model uses DeepSeek-V3's low-rank queries"
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.rope = cfg, rope
        self.q_a_proj = _linear(d, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = _linear(cfg.q_lora_rank, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(d, cfg.kv_row_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(h * cfg.v_head_dim, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        (b, t, _), h, n = x.shape, cfg.num_attention_heads, cfg.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, h, cfg.qk_head_dim)
        q_pe = self.rope.apply(q[..., n:], cos[:, None], sin[:, None])  # [B, T, H, r]
        latent = self.kv_a_proj_with_mqa(x)  # [B, T, R + r]
        c_kv = self.kv_a_layernorm(latent[..., : cfg.kv_lora_rank])
        k_pe = self.rope.apply(latent[..., cfg.kv_lora_rank :], cos, sin)  # [B, T, r]
        kv = self.kv_b_proj(c_kv).view(b, t, h, n + cfg.v_head_dim)
        k = torch.cat([kv[..., :n], k_pe[:, :, None].expand(-1, -1, h, -1)], dim=-1)
        q = torch.cat([q[..., :n], q_pe], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), kv[..., n:].transpose(1, 2),
            is_causal=True, scale=cfg.softmax_scale,
        )  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * cfg.v_head_dim))


class MLP(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(d, inter), _linear(d, inter), _linear(inter, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Sigmoid noaux_tc gate (the engine's `select_experts`), stacked routed experts, shared experts.
    The correction bias is a buffer moved by `balance()` (DeepSeek's auxiliary-loss-free balancing)."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.cfg = cfg
        self.gate_weight = nn.Parameter(torch.randn(e, d) * d**-0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.gate_up = nn.Parameter(torch.randn(e, 2 * i, d) * d**-0.5)  # [E, 2I, D]
        self.down = nn.Parameter(torch.randn(e, d, i) * i**-0.5)  # [E, D, I]
        self.shared_experts = MLP(d, i * cfg.n_shared_experts)
        self.load = torch.zeros(e)  # tokens per expert since the last balance()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        weights, ids = select_experts(
            F.linear(x.float(), self.gate_weight), self.cfg, self.e_score_correction_bias
        )
        k = ids.shape[1]
        flat = ids.flatten()
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0])
        self.load += counts.detach().float()
        order = flat.argsort(stable=True)
        token = order // k
        xs, outs, start = x[token], [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = F.linear(xs[start : start + n], self.gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down[e]))
                start += n
        y = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)
        y = torch.zeros_like(x).index_add(0, token, y)
        return (y + self.shared_experts(x)).view(shape)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Move the selection bias toward equal load: up for underloaded experts, down for overloaded."""
        if self.load.sum() > 0:
            self.e_score_correction_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        moe = cfg.is_moe_layer(layer_id)
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPModule(nn.Module):
    """One multi-token-prediction depth: block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])) -> t_{i+2}.
    Embedding and output head are the main model's (DeepSeek shares them; the checkpoint stores copies)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        d = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * d, d)
        self.block: DecoderLayer = DecoderLayer(cfg, rope, cfg.num_hidden_layers)
        self.shared_head_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor, cos, sin) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        return self.shared_head_norm(self.block(x, cos, sin))


class DemoDeepseekV3(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = MTPModule(cfg, self.rope) if cfg.num_nextn_predict_layers else None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (logits [B, T, vocab] for t+1, MTP logits [B, T-1, vocab] for t+2 or None)."""
        cos, sin = self.rope.cos_sin(torch.arange(ids.shape[1]))
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        if self.mtp is None:
            return logits, None
        emb_next = self.embed_tokens(ids[:, 1:])
        mtp_hidden = self.mtp(emb_next, hidden[:, :-1], cos[:-1], sin[:-1])
        return logits, self.lm_head(mtp_hidden)

    def moes(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Every tensor under DeepSeek-V3's checkpoint name, float32, contiguous (copies)."""
        return {k: v.detach().float().contiguous().clone() for k, v in self._hf_views().items()}

    @torch.no_grad()
    def load_state_dict_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of state_dict_hf (every name must be there; shared copies must agree)."""
        views = self._hf_views()
        if set(views) != set(tensors):
            raise ValueError(f"names differ: {sorted(set(views) ^ set(tensors))[:8]}")
        for name, view in views.items():
            view.copy_(tensors[name])

    def _hf_views(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        for i, layer in enumerate(self.layers):
            out |= _layer_tensors(f"model.layers.{i}", layer)
        if self.mtp is not None:
            p = f"model.layers.{self.cfg.num_hidden_layers}"
            out |= _layer_tensors(p, self.mtp.block)
            out |= {
                f"{p}.enorm.weight": self.mtp.enorm.weight,
                f"{p}.hnorm.weight": self.mtp.hnorm.weight,
                f"{p}.eh_proj.weight": self.mtp.eh_proj.weight,
                f"{p}.embed_tokens.weight": self.embed_tokens.weight,
                f"{p}.shared_head.norm.weight": self.mtp.shared_head_norm.weight,
                f"{p}.shared_head.head.weight": self.lm_head.weight,
            }
        return {k: v.detach() for k, v in out.items()}


def _layer_tensors(prefix: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.{k}": v for k, v in layer.state_dict().items() if not k.startswith("mlp.")}
    mlp = layer.get_submodule("mlp")
    if not isinstance(mlp, MoE):
        return out | {f"{prefix}.mlp.{k}": v for k, v in mlp.state_dict().items()}
    p = f"{prefix}.mlp"
    out[f"{p}.gate.weight"] = mlp.gate_weight
    out[f"{p}.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
    half = mlp.gate_up.shape[1] // 2
    for e in range(mlp.gate_up.shape[0]):
        out[f"{p}.experts.{e}.gate_proj.weight"] = mlp.gate_up[e, :half]
        out[f"{p}.experts.{e}.up_proj.weight"] = mlp.gate_up[e, half:]
        out[f"{p}.experts.{e}.down_proj.weight"] = mlp.down[e]
    return out | {f"{p}.shared_experts.{k}": v for k, v in mlp.shared_experts.state_dict().items()}
