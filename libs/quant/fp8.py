"""DeepSeek-V3's FP8 formats, the one home of their constants and torch math (no Triton: the CPU image
imports this; libs/kernels holds the Triton kernels of the same math and tests them against it)."""

# - Activations, 1x128: x [..., D] -> float8_e4m3fn [..., D] plus one float32 scale per row and 128-wide
#   group ([..., D/128]); scale = max(amax, min_amax) / 448, x ~= q * scale. The engine's FP8 GEMMs
#   quantize their inputs this way on the fly, and EP dispatch sends hidden states this way (DeepEP's format).
# - Weights, 128x128 blocks: a weight W [M, N] is stored as `<name>` (float8_e4m3fn [M, N]) plus
#   `<name>_scale_inv` (float32 [ceil(M/bm), ceil(N/bn)], block (bm, bn) = quantization_config's
#   weight_block_size, 128x128 in DeepSeek-V3). W = fp8 * scale_inv of its block; edge blocks are partial.

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
FP8_GROUP = 128  # activation scales: one per row and FP8_GROUP consecutive values
SCALE_SUFFIX = "_scale_inv"
ACT_MIN_AMAX = 1e-10  # the kernels' floor on a group's amax (an all-zero group gets a tiny, finite scale)
DEEPEP_MIN_AMAX = 1e-4  # DeepEP's floor (its per_token_cast_to_fp8), kept by EP dispatch


def quantize_fp8_groups(x: torch.Tensor, min_amax: float = ACT_MIN_AMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], float32 scales [..., D/128]); D a multiple of 128. Bit for bit
    what libs.kernels.quant's Triton kernels produce (with the default floor)."""
    if x.shape[-1] % FP8_GROUP:
        raise ValueError(
            f"1x{FP8_GROUP} FP8 quantization needs a last dim divisible by {FP8_GROUP}, got {x.shape[-1]}"
        )
    g = x.float().unflatten(-1, (-1, FP8_GROUP))
    s = g.abs().amax(-1).clamp(min=min_amax) / FP8_MAX
    return (g / s.unsqueeze(-1)).flatten(-2).to(FP8_DTYPE), s


def dequantize_fp8_groups(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The inverse of quantize_fp8_groups (computed in float32): q [..., D], scales [..., D/128]."""
    return (q.float().unflatten(-1, (-1, FP8_GROUP)) * scales.unsqueeze(-1)).flatten(-2).to(dtype)


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    rows = scale.repeat_interleave(block[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, : shape[1]]


def _check_scale_shape(weight_shape: tuple[int, int], scale: torch.Tensor, block: tuple[int, int]) -> None:
    want = (-(-weight_shape[0] // block[0]), -(-weight_shape[1] // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 scale has shape {tuple(scale.shape)}; a {weight_shape} weight in {block} blocks needs {want}"
        )


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """float8 [M, N] and its per-block scale_inv -> dequantized [M, N] in `dtype` (computed in float32)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block weights must be 2-D, got shape {tuple(weight.shape)}")
    shape = (weight.shape[0], weight.shape[1])
    _check_scale_shape(shape, scale_inv, block)
    w = weight.to(torch.float32) * _expand_blocks(scale_inv.to(torch.float32), shape, block)
    return w.to(dtype)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (float8_e4m3fn [M, N], float32 scale_inv [ceil(M/bm), ceil(N/bn)]), each block's amax -> 448."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block weights must be 2-D, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    bm, bn = block
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    w = torch.zeros(pm, pn, dtype=torch.float32, device=weight.device)
    w[:m, :n] = weight.to(torch.float32)
    blocks = w.view(pm // bm, bm, pn // bn, bn)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [Mb, Nb]
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(pm, pn)[:m, :n]
    return q.to(FP8_DTYPE).contiguous(), scale_inv.contiguous()


def is_fp8_weight_name(name: str) -> bool:
    """DeepSeek-V3 quantizes every projection inside the decoder layers (attention, dense MLP, shared and
    routed experts); embeddings, LM head, router gate and norms stay in high precision."""
    return name.startswith("model.layers.") and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def quantize_state_dict(
    tensors: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)
) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in DeepSeek's FP8 layout: each projection -> fp8 weight + `_scale_inv`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_fp8_weight_name(name) and tensor.dim() == 2:
            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_block(tensor, block)
        else:
            out[name] = tensor
    return out


def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict:
    """The `quantization_config` entry DeepSeek-V3's config.json carries for these weights."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
