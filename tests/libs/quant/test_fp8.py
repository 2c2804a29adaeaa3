"""DeepSeek FP8: 1x128 activation groups (scales, round trip, the amax floor) and 128x128 weight blocks against a
per-block loop, round trips, and shape errors."""

from __future__ import annotations

import pytest
import torch

from libs.quant.fp8 import (
    DEEPEP_MIN_AMAX,
    FP8_DTYPE,
    FP8_GROUP,
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_groups,
    is_fp8_weight_name,
    quantize_fp8_block,
    quantize_fp8_groups,
    quantize_state_dict,
)


def test_groups_scale_each_row_and_128_values_to_the_fp8_range() -> None:
    x = torch.randn(3, 2, 4 * FP8_GROUP, generator=torch.Generator().manual_seed(0)) * torch.logspace(
        -3, 3, 4
    ).repeat_interleave(FP8_GROUP)
    q, s = quantize_fp8_groups(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == (3, 2, 4) and s.dtype == torch.float32
    groups = x.unflatten(-1, (4, FP8_GROUP))
    torch.testing.assert_close(s, groups.abs().amax(-1) / FP8_MAX, rtol=1e-6, atol=0)
    assert (
        q.float().unflatten(-1, (4, FP8_GROUP)).abs().amax(-1) == FP8_MAX
    ).all()  # each group's max hits 448
    back = dequantize_fp8_groups(q, s)
    assert back.dtype == torch.float32
    assert (
        (back - x).abs() <= groups.abs().amax(-1).repeat_interleave(FP8_GROUP, -1) / 16
    ).all()  # e4m3: 3 bits
    assert dequantize_fp8_groups(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_groups_floor_the_scale_of_an_all_zero_group() -> None:
    x = torch.zeros(2, 2 * FP8_GROUP)
    x[1, :FP8_GROUP] = 1e-6
    q, s = quantize_fp8_groups(x)
    assert (s[0] > 0).all() and torch.equal(dequantize_fp8_groups(q, s)[0], x[0])
    q4, s4 = quantize_fp8_groups(x, DEEPEP_MIN_AMAX)  # DeepEP's floor: tiny groups keep a coarser scale
    assert s4[1, 0] == DEEPEP_MIN_AMAX / FP8_MAX and s[1, 0] < s4[1, 0]


def test_groups_need_a_multiple_of_128() -> None:
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_fp8_groups(torch.ones(2, 100))


@pytest.mark.parametrize(
    ("shape", "block"), [((256, 384), (128, 128)), ((130, 70), (128, 128)), ((50, 33), (16, 8))]
)
def test_dequantize_matches_block_loop(shape: tuple[int, int], block: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(shape, generator=gen) * 50).clamp(-448, 448).to(FP8_DTYPE)
    nb = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.rand(nb, generator=gen) + 0.01
    expected = torch.empty(shape)
    for i in range(nb[0]):
        for j in range(nb[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            expected[rows, cols] = q[rows, cols].float() * scale[i, j]
    torch.testing.assert_close(dequantize_fp8_block(q, scale, block), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("shape", "block"), [((256, 384), (128, 128)), ((130, 70), (128, 128)), ((96, 40), (32, 16))]
)
def test_round_trip_error_is_fp8_sized(shape: tuple[int, int], block: tuple[int, int]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    w[: block[0], : block[1]] *= 100  # one block with a much larger range must not hurt the others
    q, scale = quantize_fp8_block(w, block)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    back = dequantize_fp8_block(q, scale, block)
    blockwise_max = (
        scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]] * 448
    )
    assert ((back - w).abs() <= blockwise_max * 2**-4 + 1e-12).all()  # e4m3: 3 mantissa bits
    outside = torch.ones(shape, dtype=torch.bool)
    outside[: block[0], : block[1]] = False
    assert (back - w)[outside].abs().max() <= w[outside].abs().max() * 2**-4  # big block kept to itself


def test_zero_block_survives() -> None:
    w = torch.zeros(8, 8)
    q, scale = quantize_fp8_block(w, (4, 4))
    assert torch.equal(dequantize_fp8_block(q, scale, (4, 4)), w)


def test_bad_shapes_are_clear_errors() -> None:
    q = torch.zeros(130, 70).to(FP8_DTYPE)
    with pytest.raises(ValueError, match=r"scale has shape \(1, 1\).*needs \(2, 1\)"):
        dequantize_fp8_block(q, torch.ones(1, 1))
    with pytest.raises(ValueError, match="must be 2-D"):
        dequantize_fp8_block(torch.zeros(4, 4, 4).to(FP8_DTYPE), torch.ones(1, 1))


def test_state_dict_quantizes_only_projections() -> None:
    tensors = {
        "model.embed_tokens.weight": torch.randn(10, 8),
        "model.layers.0.self_attn.q_a_proj.weight": torch.randn(8, 8),
        "model.layers.1.mlp.experts.3.down_proj.weight": torch.randn(8, 4),
        "model.layers.1.mlp.gate.weight": torch.randn(4, 8),
        "model.layers.1.input_layernorm.weight": torch.randn(8),
        "lm_head.weight": torch.randn(10, 8),
    }
    out = quantize_state_dict(tensors, (4, 4))
    quantized = {n for n, t in out.items() if t.dtype == FP8_DTYPE}
    assert quantized == {
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
    }
    assert out["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    assert not is_fp8_weight_name("model.layers.1.mlp.gate.weight")
