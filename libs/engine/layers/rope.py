"""Rotary position embedding for the decoupled MLA rope dims, with DeepSeek's YaRN scaling. `apply_rope`
rotates DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... and returns the de-interleaved layout [rotated
evens, rotated odds], as DeepSeek's HF code does; the k_pe stored in the latent KV cache uses this layout."""

# Queries and keys get the same permutation, so q.k is unchanged.

from __future__ import annotations

import math

import torch

from libs.engine.config import RopeConfig


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] float32 inverse frequencies: plain RoPE, or YaRN's blend of interpolated and original."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    if rope.rope_type != "yarn":
        return extrapolated
    interpolated = 1.0 / (rope.factor * pos_freqs)
    low, high = _correction_range(rope, dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1.0 - ramp
    return interpolated * (1.0 - keep_original) + extrapolated * keep_original


def _correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        ratio = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (dim * math.log(ratio)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding:
    """cos/sin for absolute positions; YaRN's mscale is folded into both, as DeepSeek does."""

    def __init__(self, rope: RopeConfig, dim: int, interleaved: bool, device: str | torch.device = "cpu"):
        self.dim = dim
        self.interleaved = interleaved
        self.scale = rope.cos_sin_scale
        self.inv_freq = yarn_inv_freq(rope, dim).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim/2] float32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., dim]; cos/sin must broadcast against x[..., :dim/2]."""
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
