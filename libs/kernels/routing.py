"""DeepSeek-V3's noaux_tc router in one Triton program per token, the same function as transformers'
DeepseekV3TopkRouter (the oracle here) in one launch instead of about a dozen: selection by biased sigmoid
scores within the best `topk_group` groups, weights from the unbiased scores."""

# scores = sigmoid(logits); choice = scores + e_score_correction_bias; a group's score is the sum of its two
# best choices; the other groups are masked; the top-k by choice are weighted by their unbiased scores,
# renormalized when norm_topk_prob, times routed_scaling_factor.

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    LOGITS, BIAS, W_OUT, ID_OUT, stride_l, scaling, shared_id,
    N_EXP: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
    TOPK_POW2: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    PER: tl.constexpr = N_EXP // N_GROUP
    offs = tl.arange(0, N_GROUP)[:, None] * PER + tl.arange(0, PER)[None, :]  # [G, PER]
    logits = tl.load(LOGITS + t.to(tl.int64) * stride_l + offs).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores + tl.load(BIAS + offs).to(tl.float32)
    neg = float("-inf")
    best = tl.max(choice, 1)
    first = tl.argmax(choice, 1)
    second = tl.max(tl.where(tl.arange(0, PER)[None, :] == first[:, None], neg, choice), 1)
    group_score = best + second  # [G]
    gidx = tl.arange(0, N_GROUP)
    keep = tl.zeros([N_GROUP], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(tl.where(keep, neg, group_score), 0)
        keep = keep | (gidx == g)
    choice = tl.where(keep[:, None], choice, neg)
    flat_choice = tl.reshape(choice, [N_EXP])
    flat_scores = tl.reshape(scores, [N_EXP])
    eidx = tl.arange(0, N_EXP)
    kidx = tl.arange(0, TOPK_POW2)
    ids = tl.zeros([TOPK_POW2], dtype=tl.int32)
    ws = tl.zeros([TOPK_POW2], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        e = tl.argmax(flat_choice, 0)
        w = tl.sum(tl.where(eidx == e, flat_scores, 0.0), 0)
        ids = tl.where(kidx == k, e, ids)
        ws = tl.where(kidx == k, w, ws)
        flat_choice = tl.where(eidx == e, neg, flat_choice)
    if NORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    ws = ws * scaling
    width: tl.constexpr = TOPK + (1 if SHARED else 0)  # SHARED: one more column, the shared expert at weight 1
    if SHARED:
        ids = tl.where(kidx == TOPK, shared_id, ids)
        ws = tl.where(kidx == TOPK, 1.0, ws)
    tl.store(W_OUT + t * width + kidx, ws, mask=kidx < width)
    tl.store(ID_OUT + t * width + kidx, ids, mask=kidx < width)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
    shared_expert: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype), bias [E] -> (weights [T, top_k] f32, expert ids [T, top_k] int32).
    shared_expert: also route every token to this id at weight 1, as column top_k of [T, top_k + 1] outputs
    (the shared expert as one more grouped-GEMM expert, as SGLang's shared experts fusion does)."""
    t, n_exp = logits.shape
    per = n_exp // n_group if n_group else 0
    pow2 = triton.next_power_of_2
    if n_group < 1 or n_exp % n_group or per != pow2(per) or n_group != pow2(n_group):
        raise ValueError(
            f"fused routing needs power-of-two groups and group sizes, got {n_exp} experts / {n_group} groups"
        )
    if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * per:
        raise ValueError(
            f"top_k {top_k} / topk_group {topk_group} out of range for {n_group} groups of {per}"
        )
    if logits.stride(-1) != 1:
        raise ValueError("logits need a contiguous last dimension")
    width = top_k + (shared_expert is not None)
    weights = torch.empty(t, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, width, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, bias, weights, ids, logits.stride(0), routed_scaling_factor, shared_expert or 0,
            N_EXP=n_exp, N_GROUP=n_group, TOPK_GROUP=topk_group, TOPK=top_k, TOPK_POW2=pow2(width),
            NORM=norm_topk_prob, SHARED=shared_expert is not None, num_warps=4,
        )  # fmt: skip
    return weights, ids


def route_reference(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob=True):
    """transformers' DeepseekV3TopkRouter.get_topk_indices + weighting, in float32."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    t, n_exp = scores.shape
    group_scores = choice.view(t, n_group, -1).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, n_exp // n_group).reshape(t, -1)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.int()
