"""Expert selection against transformers' routers, and the properties the gates promise."""

from __future__ import annotations

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.layers.router import select_experts
from tests.libs.engine.hf_utils import TINY_V3


def _cfg(**overrides) -> ModelConfig:
    from transformers import DeepseekV2Config, DeepseekV3Config

    arch = overrides.pop("arch", "deepseek_v3")
    cls = DeepseekV3Config if arch == "deepseek_v3" else DeepseekV2Config
    return ModelConfig.from_dict(cls(**{**TINY_V3, **overrides}).to_dict())


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _hf_route(cfg: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None, arch: str, **overrides):
    """Run transformers' router with an identity gate matrix, so its router logits are `logits`."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e = cfg.n_routed_experts
    if arch == "deepseek_v3":
        router = DeepseekV3TopkRouter(DeepseekV3Config(**{**TINY_V3, **overrides, "hidden_size": e}))
        router.e_score_correction_bias.copy_(bias)
    else:
        router = DeepseekV2TopkRouter(DeepseekV2Config(**{**TINY_V3, **overrides, "hidden_size": e}))
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))
        _, w, ids = router(logits)
    return w, ids


V3_CASES = [
    dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2),
    dict(n_routed_experts=16, n_group=4, topk_group=1, num_experts_per_tok=3, routed_scaling_factor=1.0),
    dict(n_routed_experts=32, n_group=8, topk_group=4, num_experts_per_tok=8, norm_topk_prob=False),
    dict(n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=1),
]


@pytest.mark.parametrize("overrides", V3_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_noaux_tc_matches_transformers(overrides: dict, seed: int) -> None:
    cfg = _cfg(**overrides)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, cfg.n_routed_experts, generator=gen) * 2
    bias = torch.randn(cfg.n_routed_experts, generator=gen) * 0.5
    ours = _sorted(*select_experts(logits, cfg, bias))
    theirs = _sorted(*_hf_route(cfg, logits, bias, "deepseek_v3", **overrides))
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(topk_method="greedy", n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=1.0),
        dict(topk_method="group_limited_greedy", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
             routed_scaling_factor=16.0),
    ],
)  # fmt: skip
def test_softmax_gates_match_transformers(overrides: dict) -> None:
    overrides = {**overrides, "norm_topk_prob": False}  # transformers' V2 router ignores norm_topk_prob
    cfg = _cfg(arch="deepseek_v2", **overrides)
    logits = torch.randn(64, cfg.n_routed_experts, generator=torch.Generator().manual_seed(5)) * 2
    ours = _sorted(*select_experts(logits, cfg))
    theirs = _sorted(*_hf_route(cfg, logits, None, "deepseek_v2", **overrides))
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0])


def test_correction_bias_steers_selection_but_not_weights() -> None:
    cfg = _cfg(n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False)
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 always wins selection...
    weights, ids = select_experts(logits, cfg, bias)
    assert (ids == 5).any(dim=1).all()
    # ...but is weighted by its own unbiased sigmoid score, times the scaling factor
    expected = logits.sigmoid().gather(1, ids) * cfg.routed_scaling_factor
    torch.testing.assert_close(weights, expected)


def test_group_limit_keeps_experts_inside_best_groups() -> None:
    cfg = _cfg(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    logits = torch.randn(128, 16, generator=torch.Generator().manual_seed(2)) * 3
    _, ids = select_experts(logits, cfg, torch.zeros(16))
    groups = ids // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_v2_gate_renormalizes_or_scales_never_both() -> None:
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    base = dict(arch="deepseek_v2", topk_method="greedy", n_routed_experts=8, routed_scaling_factor=3.0)
    normed, _ = select_experts(logits, _cfg(**base, num_experts_per_tok=2, norm_topk_prob=True))
    torch.testing.assert_close(normed.sum(-1), torch.ones(16))
    scaled, ids = select_experts(logits, _cfg(**base, num_experts_per_tok=2, norm_topk_prob=False))
    torch.testing.assert_close(scaled, logits.softmax(-1).gather(1, ids) * 3.0)
    single, ids = select_experts(logits, _cfg(**base, num_experts_per_tok=1, norm_topk_prob=True))
    torch.testing.assert_close(single, logits.softmax(-1).gather(1, ids) * 3.0)


def test_v3_gate_renormalizes_then_scales() -> None:
    cfg = _cfg(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3, routed_scaling_factor=2.5)
    weights, _ = select_experts(torch.randn(16, 8), cfg, torch.zeros(8))
    torch.testing.assert_close(weights.sum(-1), torch.full((16,), 2.5))
