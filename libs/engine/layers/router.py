"""MoE routing: which K experts each token goes to, and with what weight (pure tensor functions), for the
three DeepSeek gates chosen by the config's `topk_method`: `noaux_tc` (V3, Kimi-K2, Moonlight), `greedy`
(V2-Lite) and `group_limited_greedy` (V2)."""

# Legend: T tokens, E routed experts, G expert groups, K experts per token.
# noaux_tc: sigmoid scores; `e_score_correction_bias` is added for selection only (groups ranked by the sum
# of their top-2 biased scores, then top-K inside the best `topk_group` groups); the weights are the unbiased
# scores, renormalized when `norm_topk_prob`, then always times `routed_scaling_factor`. greedy: softmax,
# plain top-K. group_limited_greedy: softmax, groups ranked by their best expert. V2 gates renormalize (when
# norm_topk_prob and K > 1) or scale by routed_scaling_factor, never both, as DeepSeek's V2 code does.

from __future__ import annotations

import torch

from libs.engine.config import ModelConfig


def select_experts(
    router_logits: torch.Tensor, cfg: ModelConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (weights [T, K] float32, expert ids [T, K] int64)."""
    k = cfg.num_experts_per_tok
    if cfg.scoring_func == "sigmoid":
        scores = router_logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        group_scores = _grouped(choice, cfg.n_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        ids = _topk_in_groups(choice, group_scores, cfg.topk_group, k)
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids

    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if cfg.topk_method == "group_limited_greedy":
        group_scores = _grouped(scores, cfg.n_group).max(dim=-1).values
        ids = _topk_in_groups(scores, group_scores, cfg.topk_group, k)
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    if k > 1 and cfg.norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
    return weights * cfg.routed_scaling_factor, ids


def _grouped(scores: torch.Tensor, n_group: int) -> torch.Tensor:
    """[T, E] -> [T, G, E/G]: DeepSeek's groups are contiguous expert id ranges."""
    return scores.view(scores.shape[0], n_group, -1)


def _topk_in_groups(
    choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int, k: int
) -> torch.Tensor:
    """Top-k of `choice` [T, E] among the experts of each token's `topk_group` best groups."""
    n_group = group_scores.shape[1]
    if topk_group < n_group:
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = (
            group_mask.unsqueeze(-1).expand(-1, -1, choice.shape[1] // n_group).reshape(choice.shape)
        )
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(choice, k=k, dim=-1, sorted=False).indices
