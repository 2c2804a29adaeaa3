"""The decoder's fused path: the same DeepSeek-V3 layers run as the fewest kernels the backend has.
`enable(model)` decides once, after loading, whether a model can take it (FP8 weights on the kernel backend,
16-bit activations, DeepSeek's MLA dims, paged attention kernels); anything else keeps the plain reference."""

# Legend: T tokens, D hidden, H heads, N nope dim, r rope dim, R kv_lora_rank, V v dim, E local experts,
# K experts per token, Q q_lora_rank.
# Per layer: the residual is carried through; input norm = residual add + RMSNorm into the 1x128 FP8 input
# of one stacked q_a/kv_a GEMM (`add_rmsnorm_quant`); the q latent norm goes straight to FP8; RoPE of q and k,
# the kv latent norm and the cache write are one kernel (`rope_and_write_kv`); decode runs absorbed MLA with
# o_proj's input quantized from W_UV's per-head output (`quant_fp8_heads`), prefill the backend's expanded
# attention; the MoE routes with the fused noaux_tc kernel and runs the shared expert as one more expert of
# the grouped FP8 GEMM (stacked after the routed ones as views of one tensor, so weights still load by name).
# `MoEFast.emulate_ep` maps each token's picks onto a rank's local experts (libs.ep.emulated).

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("moemesh.engine")

NORM_EPS = 1e-6  # MLA's q_a / kv_a latent norms


@dataclass
class AttentionFast:
    qkv_a: tuple[torch.Tensor, torch.Tensor]  # stacked [Q + R + r, D] FP8 (q_a rows, then kv_a) and scales


@dataclass
class MoEFast:
    # [D, E_logical] router weight in the activation dtype when that holds it exactly (DeepSeek's checkpoints
    # store the gate in bf16): a 16-bit GEMM with fp32 output gives the plain router's logits; None: fp32 GEMM
    gate_t: torch.Tensor | None
    w13: tuple[torch.Tensor, torch.Tensor]  # [E (+1 shared), 2I, D] FP8 and scales
    w2: tuple[torch.Tensor, torch.Tensor]  # [E (+1), D, I]
    shared_id: int | None  # local id of the shared expert in the stacks, None when the model has none
    # routed logical picks [T, K] -> local expert ids (an emulated EP rank); None: every expert is local
    emulate_ep: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class ModelFast:
    cos_sin: torch.Tensor  # [max_pos, r] float32: cos (r/2) then sin (r/2), YaRN mscale folded in
    eps: float


def _fp8(linear) -> bool:
    return getattr(linear, "weight_scale_inv", None) is not None


def unsupported(model) -> str | None:
    """Why `model` cannot take the fused path, or None when it can."""
    from libs.kernels.fp8_gemm import triton_usable

    cfg = model.config
    if model.dtype not in (torch.bfloat16, torch.float16):
        return f"activations are {model.dtype}, the fused kernels take 16-bit"
    if not triton_usable(torch.empty(0, device=model.device)):
        return "no Triton backend on this device"
    if cfg.q_lora_rank is None or cfg.q_lora_rank % 128:
        return "q_lora_rank must exist and be a multiple of 128 (stacked q_a/kv_a FP8 rows)"
    if cfg.kv_lora_rank != 512 or cfg.qk_rope_head_dim != 64 or cfg.v_head_dim != 128 or not cfg.rope_interleave:
        return "the fused MLA kernels take DeepSeek's dims (R 512, r 64 interleaved, V 128)"
    h = cfg.num_attention_heads
    if h & (h - 1):
        return f"{h} heads: the RoPE/KV-write kernel takes a power of two"
    for layer in model.model.layers:
        a = layer.self_attn
        if not all(_fp8(p) for p in (a.q_a_proj, a.kv_a_proj_with_mqa, a.q_b_proj, a.o_proj)):
            return "attention projections are not FP8"
    return None


def enable(model) -> bool:
    """Prepare `model` (weights loaded) for the fused path; False (with a log line) when it cannot take it."""
    if model.fast is not None:
        return True
    reason = unsupported(model)
    if reason is not None:
        log.info("fused decoder path off: %s", reason)
        return False
    cfg = model.config
    for layer in model.model.layers:
        a = layer.self_attn
        a.fast = AttentionFast(_stack_rows_fp8(a.q_a_proj, a.kv_a_proj_with_mqa))
        moe = layer.mlp
        if hasattr(moe, "experts"):
            moe.fast = _moe_fast(moe, cfg, model.dtype)
    max_pos = cfg.max_position_embeddings
    pos = torch.arange(max_pos, device=model.device)
    cos, sin = model.rope.cos_sin(pos)
    model.fast = ModelFast(torch.cat([cos, sin], dim=-1).contiguous(), cfg.rms_norm_eps)
    return True


def _stack_rows_fp8(first, second) -> tuple[torch.Tensor, torch.Tensor]:
    """Two loaded FP8 Linears of one K as one stacked weight; each keeps a row view of it (no copy kept)."""
    weight = torch.cat([first.weight.data, second.weight.data])
    scale = torch.cat([first.weight_scale_inv.data, second.weight_scale_inv.data])
    n1, b1 = first.weight.shape[0], first.weight_scale_inv.shape[0]
    first.weight = nn.Parameter(weight[:n1], requires_grad=False)
    first.weight_scale_inv = nn.Parameter(scale[:b1], requires_grad=False)
    second.weight = nn.Parameter(weight[n1:], requires_grad=False)
    second.weight_scale_inv = nn.Parameter(scale[b1:], requires_grad=False)
    return weight, scale


def _moe_fast(moe, cfg, dtype: torch.dtype) -> MoEFast | None:
    ex = moe.experts
    if not ex.is_fp8 or moe.ep is not None or not _fused_routing(cfg):
        return None
    shared = moe.shared_experts
    stack_shared = shared is not None and shared.is_fp8 and shared.down_proj.weight.shape == ex.down_proj.shape[1:]
    if shared is not None and not stack_shared:
        return None  # a shared expert wider than a routed one: the plain FP8 path adds it
    e = ex.gate_up_proj.shape[0]
    gate_t = _router_16bit(moe.gate.weight.data, dtype)
    if not stack_shared:
        return MoEFast(
            gate_t, (ex.gate_up_proj, ex.gate_up_proj_scale_inv), (ex.down_proj, ex.down_proj_scale_inv), None
        )
    assert shared.gate_up is not None
    w13 = torch.cat([ex.gate_up_proj.data, shared.gate_up[0][None]])
    s13 = torch.cat([ex.gate_up_proj_scale_inv.data, shared.gate_up[1][None]])
    w2 = torch.cat([ex.down_proj.data, shared.down_proj.weight.data[None]])
    s2 = torch.cat([ex.down_proj_scale_inv.data, shared.down_proj.weight_scale_inv.data[None]])
    for name, full in (("gate_up_proj", w13), ("gate_up_proj_scale_inv", s13), ("down_proj", w2),
                       ("down_proj_scale_inv", s2)):  # fmt: skip
        setattr(ex, name, nn.Parameter(full[:e], requires_grad=False))
    i2 = w13.shape[1]
    shared.gate_proj.weight = nn.Parameter(w13[e, : i2 // 2], requires_grad=False)
    shared.up_proj.weight = nn.Parameter(w13[e, i2 // 2 :], requires_grad=False)
    b = s13.shape[1] // 2
    shared.gate_proj.weight_scale_inv = nn.Parameter(s13[e, :b], requires_grad=False)
    shared.up_proj.weight_scale_inv = nn.Parameter(s13[e, b:], requires_grad=False)
    shared.gate_up = (w13[e], s13[e])
    shared.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
    shared.down_proj.weight_scale_inv = nn.Parameter(s2[e], requires_grad=False)
    return MoEFast(gate_t, (w13, s13), (w2, s2), e)



def _router_16bit(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The router weight as [D, E] in `dtype` if that is lossless and the device has a 16-bit GEMM with
    fp32 output (CUDA), else None (the fp32 GEMM the plain router runs: 4x the time at decode sizes)."""
    if not weight.is_cuda or not torch.equal(weight.to(dtype).to(weight.dtype), weight):
        return None
    return weight.to(dtype).t().contiguous()


def _fused_routing(cfg) -> bool:
    n, g = cfg.n_routed_experts, cfg.n_group

    def pow2(x: int) -> bool:
        return x > 0 and x & (x - 1) == 0

    return cfg.scoring_func == "sigmoid" and cfg.topk_method == "noaux_tc" and g >= 1 and n % g == 0 and (
        pow2(g) and pow2(n // g)
    )


# --- forwards ---


def decoder_layer(layer, h: torch.Tensor, residual: torch.Tensor, step, kv, fast: ModelFast) -> torch.Tensor:
    """One layer: h [T, D] is the previous layer's output, residual [T, D] is updated in place."""
    from libs.kernels import fused

    x8 = fused.add_rmsnorm_quant(h, layer.input_layernorm.weight, fast.eps, residual=residual)
    h = attention(layer.self_attn, x8, step, kv, fast)
    x = fused.add_rmsnorm(h, layer.post_attention_layernorm.weight, fast.eps, residual=residual)
    mlp = layer.mlp
    if getattr(mlp, "fast", None) is not None and mlp.ep is None:  # an EP hook set later takes the plain MoE
        return moe(mlp, x)
    return mlp(x)


def final_norm(norm, h: torch.Tensor, residual: torch.Tensor, fast: ModelFast) -> torch.Tensor:
    from libs.kernels import fused

    return fused.add_rmsnorm(h, norm.weight, fast.eps, residual=residual)


def attention(attn, x8: tuple[torch.Tensor, torch.Tensor], step, kv, fast: ModelFast) -> torch.Tensor:
    from libs.kernels import fp8_gemm, fused, quant

    t = x8[0].shape[0]
    h, n, r, q_lora, lat = attn.num_heads, attn.nope_dim, attn.rope_dim, attn.q_a_proj.weight.shape[0], attn.kv_lora_rank
    (xq, xs), (w_a, s_a) = x8, attn.fast.qkv_a
    qkv = fp8_gemm.fp8_gemm(xq, xs, w_a, s_a, out_dtype=attn.o_proj.dtype)  # [T, Q + R + r]
    q_q, q_s = fused.add_rmsnorm_quant(qkv[:, :q_lora], attn.q_a_layernorm.weight, NORM_EPS)
    q = fp8_gemm.fp8_gemm(q_q, q_s, attn.q_b_proj.weight, attn.q_b_proj.weight_scale_inv, out_dtype=qkv.dtype)
    q = q.view(t, h, n + r)
    # decode rotates into a [T, H, r] tensor of its own; prefill in place, so that q stays the one [T, H, N + r]
    # query the expanded attention takes (mla.joined_query: no copy)
    q_pe = torch.empty(t, h, r, dtype=q.dtype, device=q.device) if step.absorbed else q[..., n:]
    rows = kv.layer(attn.layer_id)
    fused.rope_and_write_kv(
        q[..., n:], q_pe, qkv[:, q_lora + lat :], qkv[:, q_lora : q_lora + lat], rows, step.positions,
        step.out_slots, fast.cos_sin, kv_norm=attn.kv_a_layernorm.weight, eps=NORM_EPS,
    )  # fmt: skip
    weights = attn.mla_weights()
    if step.absorbed:
        q_lat = torch.bmm(q[..., :n].transpose(0, 1), weights.w_uk)  # [H, T, R]
        latent = step.backend.decode_latent(q_lat.transpose(0, 1), q_pe, rows, step.meta)  # [T, H, R]
        o = torch.bmm(latent.transpose(0, 1), weights.w_uv.transpose(1, 2))  # [H, T, V]
        o8 = quant.quant_fp8_heads(o.transpose(0, 1))  # gathered into token rows by the quantization
    else:
        o = step.backend.attend(q[..., :n], q_pe, rows, weights, step)  # [T, H, V]
        o8 = quant.quant_fp8_heads(o)
    return fp8_gemm.fp8_gemm(o8[0], o8[1], attn.o_proj.weight, attn.o_proj.weight_scale_inv, out_dtype=qkv.dtype)


def moe(block, x: torch.Tensor) -> torch.Tensor:
    """Router (fused noaux_tc, shared expert appended) -> grouped FP8 experts -> weighted combine."""
    from libs.kernels import backend, routing

    fast: MoEFast = block.fast
    cfg = block.gate.cfg
    if fast.gate_t is not None:  # [T, E_logical] float32, as the plain router's
        logits = torch.mm(x, fast.gate_t, out_dtype=torch.float32)
    else:
        logits = torch.nn.functional.linear(x.float(), block.gate.weight)
    weights, ids = routing.route(
        logits, block.gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
        cfg.routed_scaling_factor, cfg.norm_topk_prob, shared_expert=fast.shared_id,
    )  # fmt: skip
    k = cfg.num_experts_per_tok
    rows_per_expert = None
    if fast.emulate_ep is not None:
        ids[:, :k] = fast.emulate_ep(ids[:, :k])
        rows_per_expert = x.shape[0] * k  # several picks of one token can land on one local expert
    return backend.fp8_moe(x, ids, weights, fast.w13, fast.w2, masked=backend_masked(x, ids, fast),
                           m_max=rows_per_expert, all_local=True)  # fmt: skip


def backend_masked(x: torch.Tensor, ids: torch.Tensor, fast: MoEFast) -> bool:
    from libs.engine.layers.fp8_linear import use_masked_moe

    return use_masked_moe(x.shape[0], ids.shape[1], fast.w13[0].shape[0])
