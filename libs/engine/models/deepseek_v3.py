"""DeepSeek-V3 architecture (also V2, V2-Lite, Kimi-K2, Moonlight): MLA attention and DeepSeekMoE. Module and
parameter names are the Hugging Face checkpoint names, except routed experts, stacked per layer
(`CHECKPOINT_EXPERT_NAME` maps them); parameters are uninitialized until the loader fills every one."""

# Legend: T new tokens in the batch, D hidden, H heads, N qk_nope_head_dim, r qk_rope_head_dim,
# R kv_lora_rank, V v_head_dim, E routed experts, I moe_intermediate_size, K experts per token.
# Experts stack as [E, 2I, D] gate+up and [E, D, I] down, as transformers 5 and grouped GEMMs want. The
# router weight and correction bias stay float32 whatever the model dtype, as DeepSeek runs them.

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from libs.engine.config import ModelConfig
from libs.engine.forward_batch import ForwardBatch
from libs.engine.kv_pool import KVPool
from libs.engine.layers import fast_path, fp8_linear
from libs.engine.layers.attention_backend import (
    AttentionBackend,
    MLAWeights,
    StepInputs,
    TorchAttention,
    TritonAttention,
    make_attention_backend,
)
from libs.engine.layers.rope import RotaryEmbedding
from libs.engine.layers.router import select_experts

ATTN_MODES = ("auto", "absorbed", "expanded")

# checkpoint name of one routed expert's projection (or its FP8 block scales: group 4) -> (stacked
# parameter, which rows of it)
CHECKPOINT_EXPERT_NAME = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$"
)
_STACKED_EXPERT_PARAM = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). Dense by default; `to_fp8()` (called by the loader for FP8 checkpoints) makes `weight`
    float8_e4m3fn [N, K] with `weight_scale_inv` [ceil(N/128), K/128], run by the block-scaled FP8 GEMM."""

    def __init__(self, d_in: int, d_out: int, bias: bool, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.dtype = dtype
        self.weight = _param(d_out, d_in, dtype=dtype, device=device)
        self.bias = _param(d_out, dtype=dtype, device=device) if bias else None
        self.weight_scale_inv: nn.Parameter | None
        self.register_parameter("weight_scale_inv", None)
        self._dense: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return F.linear(x, self.weight, self.bias)
        y = fp8_linear.linear_forward(x, self.weight, self.weight_scale_inv)
        return y if self.bias is None else y + self.bias

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense [N, K] matrix in the model dtype, for code that reads it as a matrix (MLA's
        absorbed W_UK/W_UV): the parameter itself, or for FP8 its dequantized copy, made once and remade
        only if the weight is loaded again."""
        if self.weight_scale_inv is None:
            return self.weight
        key = (self.weight._version, self.weight_scale_inv._version)
        if self._dense is None or self._dense[0] != key:
            self._dense = (key, fp8_linear.dequantized(self.weight, self.weight_scale_inv, self.dtype))
        return self._dense[1]

    # --- FP8 conversion (libs.engine.layers.fp8_linear.apply_fp8_weights) ---
    def fp8_checkpoint_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.weight"]

    def fp8_unsupported(self, block: tuple[int, int]) -> str | None:
        return fp8_linear.unsupported(self.weight.shape[1], block)

    def to_fp8(self) -> None:
        n, k = self.weight.shape
        device = self.weight.device
        self.weight = fp8_linear.fp8_param(n, k, device=device)
        self.weight_scale_inv = fp8_linear.scale_param(n, k, device=device)
        self._dense = None


class Embedding(nn.Module):
    """Token embedding table; also the tied LM head (same Parameter) when tie_word_embeddings."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _param(vocab, dim, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """MLA: writes each new token's latent row into the pool, then attends in expanded or absorbed form."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer_id: int, dtype: torch.dtype, device):
        super().__init__()
        self.layer_id = layer_id
        self.rope = rope
        self.num_heads, self.nope_dim, self.rope_dim = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.kv_lora_rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        h, d, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, False, dtype, device)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias, dtype, device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, device)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_row_dim, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, device)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dtype, device
        )
        self.o_proj = Linear(h * cfg.v_head_dim, d, bias, dtype, device)
        self._mla_weights: tuple[tuple[int, int], MLAWeights] | None = None
        self.fast: fast_path.AttentionFast | None = None  # set by fast_path.enable

    def mla_weights(self) -> MLAWeights:
        """kv_b_proj as the attention paths read it (dense, W_UK/W_UV views): made on first use after
        loading and remade only when the weight changes, never per step (and never inside a CUDA graph
        capture, which always follows an eager warm-up)."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version)
        if self._mla_weights is None or self._mla_weights[0] != key:
            dense = self.kv_b_proj.dense_weight()
            self._mla_weights = (key, MLAWeights.from_dense(dense, self.num_heads, self.nope_dim))
        return self._mla_weights[1]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs, kv: KVPool
    ) -> torch.Tensor:
        """`step` names the attention backend, its metadata and the new tokens' pool slots."""
        t = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, N + r]
        q_nope, q_pe = q[..., : self.nope_dim], q[..., self.nope_dim :]
        q_pe = self.rope.apply(q_pe, cos[:, None], sin[:, None])
        latent = self.kv_a_proj_with_mqa(x)  # [T, R + r]
        c_kv = self.kv_a_layernorm(latent[:, : self.kv_lora_rank])
        k_pe = self.rope.apply(latent[:, self.kv_lora_rank :], cos, sin)
        kv.write(self.layer_id, step.out_slots, torch.cat([c_kv, k_pe], dim=-1))
        rows = kv.layer(self.layer_id)
        out = step.backend.attend(q_nope, q_pe, rows, self.mla_weights(), step)  # [T, H, V]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers and the shared experts. `to_fp8()` makes the projections FP8, gate
    and up as row views of one [2I, D] weight (and scales): the checkpoint's tensors land by name, one GEMM."""

    def __init__(self, d: int, inter: int, dtype: torch.dtype, device):
        super().__init__()
        self.gate_proj = Linear(d, inter, False, dtype, device)
        self.up_proj = Linear(d, inter, False, dtype, device)
        self.down_proj = Linear(inter, d, False, dtype, device)
        self.gate_up: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 (weight, scales), after to_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return fp8_linear.swiglu_forward(x, self.gate_up, self.down_proj)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @property
    def is_fp8(self) -> bool:
        return self.gate_up is not None

    # --- FP8 conversion (libs.engine.layers.fp8_linear.apply_fp8_weights) ---
    fp8_children_fall_back = True  # when the fused form does not fit, each Linear converts on its own

    def fp8_checkpoint_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]

    def fp8_unsupported(self, block: tuple[int, int]) -> str | None:
        d, inter = self.down_proj.weight.shape
        return fp8_linear.swiglu_unsupported(d, inter, block, "width")

    def to_fp8(self) -> None:
        self.gate_up = fp8_linear.fuse_rows_fp8(self.gate_proj, self.up_proj)
        self.down_proj.to_fp8()


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, device):
        super().__init__()
        self.cfg = cfg
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, device=device)
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = _param(cfg.n_routed_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, K] float32, expert ids [T, K]."""
        logits = F.linear(x.float(), self.weight)  # [T, E]
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class Experts(nn.Module):
    """All routed experts of one layer, stacked; each runs once over the tokens routed to it. With `to_fp8()`
    the stacks are float8_e4m3fn with block scales, run by the grouped FP8 GEMMs (layers.fp8_linear)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, num_experts: int | None = None):
        super().__init__()
        e, i, d = num_experts or cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = _param(e, 2 * i, d, dtype=dtype, device=device)  # [E, 2I, D]: gate rows, then up
        self.down_proj = _param(e, d, i, dtype=dtype, device=device)  # [E, D, I]
        self.gate_up_proj_scale_inv: nn.Parameter | None
        self.down_proj_scale_inv: nn.Parameter | None
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_proj_scale_inv is not None

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, K] -> [T, D] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (+ add)."""
        if self.is_fp8:
            return fp8_linear.experts_forward(self, x, ids, weights, add)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # [T*K] token-slots sorted by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token = order // k
        xs = x[token]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(xs[start : start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
                start += n
        y = torch.cat(outs) * weights.flatten()[order, None]
        y = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        return y if add is None else y + add

    # --- FP8 conversion (libs.engine.layers.fp8_linear.apply_fp8_weights) ---
    def fp8_checkpoint_names(self, prefix: str) -> list[str]:
        projs = ("gate_proj", "up_proj", "down_proj")
        return [f"{prefix}.{e}.{p}.weight" for e in range(self.gate_up_proj.shape[0]) for p in projs]

    def fp8_unsupported(self, block: tuple[int, int]) -> str | None:
        _, d, i = self.down_proj.shape
        return fp8_linear.swiglu_unsupported(d, i, block, "expert width")

    def to_fp8(self) -> None:
        (e, i2, d), device = self.gate_up_proj.shape, self.gate_up_proj.device
        self.gate_up_proj = fp8_linear.fp8_param(e, i2, d, device=device)
        self.gate_up_proj_scale_inv = fp8_linear.scale_param(i2, d, e, device=device)
        self.down_proj = fp8_linear.fp8_param(e, d, i2 // 2, device=device)
        self.down_proj_scale_inv = fp8_linear.scale_param(d, i2 // 2, e, device=device)


class MoE(nn.Module):
    """Router -> routed experts (+ shared experts). Expert parallelism slots in between router and experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, local_experts: int | None = None):
        super().__init__()
        self.gate = Router(cfg, device)
        self.experts = Experts(cfg, dtype, device, local_experts)
        shared = cfg.n_shared_experts * cfg.moe_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, shared, dtype, device) if shared else None
        # Expert parallelism, set from outside (libs/ep): ep(x, ids, weights[, add=shared]) -> [T, D] replaces
        # the local routed experts with dispatch -> this rank's experts -> combine; a hook whose `graph_safe`
        # is True (no host reads: libs.ep.stepped) keeps decode capturable.
        self.ep: Callable[..., torch.Tensor] | None = None
        self.fast: fast_path.MoEFast | None = None  # set by fast_path.enable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.is_fp8:
            return self._forward_fp8(x)
        weights, ids = self.gate(x)
        y = self.experts(x, ids, weights) if self.ep is None else self.ep(x, ids, weights)
        return y + self.shared_experts(x) if self.shared_experts is not None else y

    @property
    def graph_safe(self) -> bool:
        """Decode can be captured in a CUDA graph: FP8 experts take the masked layout (no host sync) under
        capture; the dense-weight path counts each expert's tokens on the host."""
        return self.experts.is_fp8 and (self.ep is None or getattr(self.ep, "graph_safe", False))

    def _forward_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """Fused router, then the grouped FP8 experts with the shared expert's output added in their combine;
        on an EP rank the hook runs dispatch -> this rank's grouped FP8 experts -> combine (+ shared)."""
        routed = fp8_linear.fused_route(self.gate, x)
        weights, ids = routed if routed is not None else self.gate(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.ep is not None:
            return self.ep(x, ids, weights, add=shared)
        return self.experts(x, ids, weights, add=shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer_id: int, dtype: torch.dtype, device,
                 local_experts: int | None = None):  # fmt: skip
        super().__init__()
        self.self_attn = Attention(cfg, rope, layer_id, dtype, device)
        if cfg.is_moe_layer(layer_id):
            self.mlp: nn.Module = MoE(cfg, dtype, device, local_experts)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, cos, sin, step, kv) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, dtype: torch.dtype, device,
                 local_experts: int | None = None):  # fmt: skip
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rope, i, dtype, device, local_experts) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DeepseekV3ForCausalLM(nn.Module):
    """One forward over a ForwardBatch: new tokens' latent rows go into `kv`; returns final-normed hidden."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        local_experts: int | None = None,
    ):  # fmt: skip
        """local_experts: build only this many routed experts per MoE layer (one EP rank's slots; the router
        still scores all n_routed_experts), None: all of them."""
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.rope = RotaryEmbedding(config.rope, config.qk_rope_head_dim, config.rope_interleave, self.device)
        self.model = Model(config, self.rope, dtype, self.device, local_experts)
        self.lm_head: Linear | Embedding
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, self.device)
        self._attention: AttentionBackend | None = None
        self._attention_format = ""  # the pool format _attention was made for
        self.fast: fast_path.ModelFast | None = None  # the fused decoder path, once enable_fast_path() said yes
        # two-batch overlap (libs/engine/two_batch_overlap.py), set from outside: forward_step(model, step, kv)
        self.tbo: Any = None

    def enable_fast_path(self) -> bool:
        """Run the fused decoder path (layers/fast_path.py) from now on, where the model allows it (after
        loading: it stacks loaded weights). The plain path stays the reference for everything else."""
        return fast_path.enable(self)

    def uses_fast_path(self, backend: AttentionBackend) -> bool:
        """Whether a forward with `backend` takes the fused path (it needs the paged kernel backends)."""
        return self.fast is not None and isinstance(backend, TritonAttention)

    def attention_backend(self, name: str = "auto", kv: KVPool | None = None) -> AttentionBackend:
        """A new attention backend for this model ("auto" | "torch" | "triton" | "flashinfer") over the rows of
        pool `kv` (None: rows in the model dtype)."""
        if kv is None:
            return make_attention_backend(name, self.config, self.device, self.dtype)
        tensor_rows = kv.fp8 is not None and kv.fp8.scales == "tensor"
        return make_attention_backend(name, self.config, self.device, self.dtype, kv.kv_cache_dtype, tensor_rows)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVPool,
        attn_mode: str = "auto",
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """-> hidden [T, D] after the final norm. attn_mode "auto": absorbed iff every sequence adds 1 token.
        backend None: the device's default ("auto"). Absorbed attention over multi-token chunks exists only
        in the torch reference, which then runs whatever backend was asked for."""
        if attn_mode not in ATTN_MODES:
            raise ValueError(f"attn_mode must be one of {ATTN_MODES}, got {attn_mode!r}")
        _check_batch(batch, kv, self.config)
        absorbed = batch.is_decode if attn_mode == "auto" else attn_mode == "absorbed"
        if backend is None:
            if self._attention is None or self._attention_format != kv.format_name:
                self._attention, self._attention_format = self.attention_backend(kv=kv), kv.format_name
            backend = self._attention
        if absorbed and not batch.is_decode and not isinstance(backend, TorchAttention):
            backend = TorchAttention(self.config, self.device, kv.kv_cache_dtype)
        return self.forward_step(backend.prepare(batch, kv.page_size, absorbed), kv)

    @torch.inference_mode()
    def forward_step(self, step: StepInputs, kv: KVPool) -> torch.Tensor:
        """The layers over inputs already on the device -> hidden [T, D]. No host syncs of its own: with a
        graph-safe backend and graph-safe MoEs (`graph_safe_decode`) a decode step can be captured."""
        if step.backend.kv_cache_dtype != kv.kv_cache_dtype:
            made, holds = step.backend.kv_cache_dtype, kv.kv_cache_dtype
            raise ValueError(f"attention backend made for {made} KV rows, the pool holds {holds}")
        if self.tbo is not None:
            return self.tbo.forward_step(self, step, kv)
        x = F.embedding(step.input_ids, self.model.embed_tokens.weight)
        if self.fast is not None and self.uses_fast_path(step.backend):
            residual = torch.zeros_like(x)
            for layer in self.model.layers:
                x = fast_path.decoder_layer(layer, x, residual, step, kv, self.fast)
            return fast_path.final_norm(self.model.norm, x, residual, self.fast)
        cos, sin = self.rope.cos_sin(step.positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, step, kv)
        return self.model.norm(x)

    def graph_safe_decode(self) -> bool:
        """Whether a decode forward can be captured in a CUDA graph: every MoE must say so (`graph_safe`,
        which the FP8 masked-layout experts set; the plain experts read counts on the host) and have no
        expert-parallel hook (its collectives are not captured)."""
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        return all(m.graph_safe for m in moes)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab] float32 (raw: in the model dtype, for the samplers that read it
        as it is: the decode step spends no pass over [N, vocab] on a cast)."""
        logits = F.linear(hidden, self.lm_head.weight)
        return logits if raw else logits.float()

    # --- weights ---
    def checkpoint_weight_names(self) -> set[str]:
        """Every tensor name a checkpoint must provide (experts per expert, tied head omitted); modules kept
        in FP8 need their `_scale_inv` tensors too."""
        names = set()
        for name, param in self.named_parameters():
            if name.endswith(".experts.gate_up_proj"):
                prefix = name.removesuffix(".gate_up_proj")
                suffixes = (
                    ("weight", "weight_scale_inv") if param.dtype == fp8_linear.FP8_DTYPE else ("weight",)
                )
                for e in range(param.shape[0]):
                    names |= {
                        f"{prefix}.{e}.{p}.{s}"
                        for p in ("gate_proj", "up_proj", "down_proj")
                        for s in suffixes
                    }
            elif not _STACKED_EXPERT_PARAM.search(name):
                names.add(name)
        return names

    def weight_target(self, name: str) -> torch.Tensor:
        """The parameter (or slice of a stacked one) that checkpoint tensor `name` fills."""
        m = CHECKPOINT_EXPERT_NAME.match(name)
        if m is None:
            return self.get_parameter(name)
        experts, e, proj, scale = m.group(1), int(m.group(2)), m.group(3), m.group(4) or ""
        if proj == "down_proj":
            return self.get_parameter(f"{experts}.down_proj{scale}")[e]
        gate_up = self.get_parameter(f"{experts}.gate_up_proj{scale}")[e]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if proj == "gate_proj" else gate_up[half:]

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        target = self.weight_target(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        if (target.dtype == fp8_linear.FP8_DTYPE) != (tensor.dtype == fp8_linear.FP8_DTYPE):
            raise ValueError(f"tensor {name}: checkpoint dtype {tensor.dtype}, model expects {target.dtype}")
        target.copy_(tensor)


def _check_batch(batch: ForwardBatch, kv: KVPool, cfg: ModelConfig) -> None:
    t = batch.input_ids.shape[0]
    if not batch.seq_lens or t == 0:
        raise ValueError("empty forward batch")
    if sum(batch.extend_lens) != t or batch.positions.shape[0] != t or batch.out_slots.shape[0] != t:
        raise ValueError(f"batch has {t} input ids but extend_lens sum to {sum(batch.extend_lens)}")
    if len(batch.extend_lens) != batch.num_seqs or len(batch.page_tables) != batch.num_seqs:
        raise ValueError("extend_lens, seq_lens and page_tables must have one entry per sequence")
    if any(e < 1 or e > s for e, s in zip(batch.extend_lens, batch.seq_lens, strict=True)):
        raise ValueError("every sequence needs 1 <= extend_len <= seq_len")
    if kv.num_layers != cfg.num_hidden_layers or kv.row_dim != cfg.kv_row_dim:
        raise ValueError(
            f"KV pool is [{kv.num_layers} layers, {kv.row_dim} wide]; model needs "
            f"[{cfg.num_hidden_layers}, {cfg.kv_row_dim}]"
        )
