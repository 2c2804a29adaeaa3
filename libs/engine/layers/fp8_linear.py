"""FP8 block-scaled weights kept in FP8: which modules can hold them (`apply_fp8_weights` converts a freshly
built model before loading) and the forwards that run on them (libs.kernels.backend). What cannot stay FP8
is left dense with a log line and dequantized by the loader: never a silently wrong layout."""

# Legend: T tokens, D hidden, N out features, K in features, E routed experts, I expert width.
# `<p>.weight` float8_e4m3fn [N, K] with `<p>.weight_scale_inv` float32 [ceil(N/128), K/128] lands by name on
# a module with parameters of exactly those shapes; routed experts stay stacked: gate_up_proj [E, 2I, D]
# (scales [E, 2I/128, D/128], gate blocks then up blocks), down_proj [E, D, I] (scales [E, D/128, I/128]).
# Left dense: K not a multiple of 128, a block other than 128x128, an expert width putting gate and up rows in
# one scale block, and kv_b_proj (MLA reads it as a matrix for absorbed W_UK/W_UV, never runs it as a Linear).
# The kernels are imported lazily: Triton picks interpreter or compiler when they are first imported.

from __future__ import annotations

import logging
from collections.abc import Collection

import torch
from torch import nn

from libs.quant.fp8 import FP8_DTYPE, dequantize_fp8_block

log = logging.getLogger("moemesh.engine")

KERNEL_BLOCK = (128, 128)  # the only weight block the Triton GEMMs take
DENSE_ONLY = ("kv_b_proj",)  # read as a matrix by MLA, never run as a Linear
# Masked (graph-safe) MoE layout while its [E, T, ...] buffers stay small: at most this many token-expert
# pairs, and E * T rows (256 experts: decode batches up to 512). Beyond that, prefill-sized batches take
# the contiguous layout (sorted by expert, padded per expert). Chosen from buffer sizes, not measured yet.
MASKED_MAX_PAIRS = 8192
MASKED_MAX_ROWS = 131072


def fp8_param(*shape: int, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE, device=device), requires_grad=False)


def scale_param(n: int, k: int, *lead: int, device: torch.device | str) -> nn.Parameter:
    """float32 [*lead, ceil(n/128), k/128]: one scale per 128x128 block of an [n, k] weight."""
    shape = (*lead, -(-n // KERNEL_BLOCK[0]), k // KERNEL_BLOCK[1])
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=device), requires_grad=False)


def unsupported(k: int, block: tuple[int, int]) -> str | None:
    """Why a weight with K in-features cannot stay FP8 for the kernels, or None when it can."""
    if tuple(block) != KERNEL_BLOCK:
        return f"weight block {tuple(block)} (the FP8 kernels take {KERNEL_BLOCK})"
    if k % KERNEL_BLOCK[1]:
        return f"K={k} is not a multiple of {KERNEL_BLOCK[1]}"
    return None


def swiglu_unsupported(d: int, inter: int, block: tuple[int, int], what: str) -> str | None:
    """`unsupported` for a SwiGLU block (hidden D, width `inter`) whose gate and up rows are stacked in one
    FP8 weight; `what` names the width in the message."""
    if inter % KERNEL_BLOCK[0]:
        return f"{what} {inter} would put gate and up rows in one 128-row scale block"
    return unsupported(d, block) or unsupported(inter, block)


def dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8_block(weight, scale, KERNEL_BLOCK, dtype)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from libs.kernels.backend import fp8_linear

    return fp8_linear(x, weight, scale)


def swiglu_forward(x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor], down) -> torch.Tensor:
    """SwiGLU MLP: fused FP8 gate/up (weight, scales) and an FP8 down Linear; x [..., D] -> [..., D]."""
    from libs.kernels.backend import fp8_swiglu_mlp

    d = x.shape[-1]
    y = fp8_swiglu_mlp(x.reshape(-1, d), gate_up, (down.weight, down.weight_scale_inv))
    return y.view(x.shape)


def fuse_rows_fp8(first, second) -> tuple[torch.Tensor, torch.Tensor]:
    """Make two Linears of one K FP8, their weights and scales row views of one stacked weight ([first;
    second]) -> (stacked weight, stacked scales). Rows of each must fill whole 128-row scale blocks."""
    (n1, k), n2 = first.weight.shape, second.weight.shape[0]
    device = first.weight.device
    weight, scale = fp8_param(n1 + n2, k, device=device), scale_param(n1 + n2, k, device=device)
    b1 = n1 // KERNEL_BLOCK[0]
    for lin, rows, blocks in (
        (first, slice(0, n1), slice(0, b1)),
        (second, slice(n1, None), slice(b1, None)),
    ):
        lin.weight = nn.Parameter(weight.data[rows], requires_grad=False)
        lin.weight_scale_inv = nn.Parameter(scale.data[blocks], requires_grad=False)
    return weight.data, scale.data


def use_masked_moe(tokens: int, top_k: int, num_experts: int) -> bool:
    """Decode-sized batches take the graph-safe masked layout (the one the graphs are made with), and so does
    anything run under CUDA-graph capture; a function of shapes otherwise, so a captured graph replays the
    path the same batch size takes eagerly."""
    small = tokens * top_k <= MASKED_MAX_PAIRS and num_experts * tokens <= MASKED_MAX_ROWS
    return small or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def experts_forward(experts, x, ids, weights, add: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 routed experts (stacked, as `Experts` holds them) -> [T, D] weighted sum (+ add)."""
    from libs.kernels.backend import fp8_moe

    masked = use_masked_moe(x.shape[0], ids.shape[1], experts.gate_up_proj.shape[0])
    w13 = (experts.gate_up_proj, experts.gate_up_proj_scale_inv)
    w2 = (experts.down_proj, experts.down_proj_scale_inv)
    return fp8_moe(x, ids, weights, w13, w2, add, masked=masked, all_local=True)  # the router's picks, all local


def fused_route(gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V3's noaux_tc gate in one fused kernel (backend.moe_route), or None where that kernel does
    not apply (other gates, group sizes that are not powers of two) and the caller runs the Router."""
    cfg = gate.cfg
    n_exp, groups = cfg.n_routed_experts, cfg.n_group
    pow2 = groups >= 1 and n_exp % groups == 0 and _is_pow2(groups) and _is_pow2(n_exp // groups)
    if cfg.scoring_func != "sigmoid" or gate.e_score_correction_bias is None or not pow2:
        return None
    from libs.kernels.backend import moe_route

    logits = torch.nn.functional.linear(x.float(), gate.weight)  # [T, E]
    return moe_route(
        logits, gate.e_score_correction_bias, cfg.num_experts_per_tok, groups, cfg.topk_group,
        cfg.routed_scaling_factor, cfg.norm_topk_prob,
    )  # fmt: skip


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def apply_fp8_weights(model: nn.Module, fp8_names: Collection[str], block: tuple[int, int]) -> set[str]:
    """Convert every module whose checkpoint weights are all FP8 (`fp8_names`: weight names that have a
    `_scale_inv` in the checkpoint) and that the kernels can run; -> the weight names now kept in FP8
    (the loader hands those over raw with their scales, and dequantizes the rest)."""
    kept: set[str] = set()
    for prefix, module in model.named_modules():  # parents first: an MLP converts its own projections
        to_fp8 = getattr(module, "to_fp8", None)
        if to_fp8 is None or module.is_fp8 or prefix.rsplit(".", 1)[-1] in DENSE_ONLY:
            continue
        names = module.fp8_checkpoint_names(prefix)
        if not names or not all(n in fp8_names for n in names):
            continue
        reason = module.fp8_unsupported(block)
        if reason is not None:
            if getattr(module, "fp8_children_fall_back", False):  # its projections get their own try
                log.debug("%s: projections converted one by one (%s)", prefix, reason)
            else:
                log.warning("%s stays dequantized (%s)", prefix, reason)
            continue
        to_fp8()
        kept.update(names)
    return kept
