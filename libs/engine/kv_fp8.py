"""The FP8 latent KV rows (kv_cache_dtype "fp8_e4m3"): one token's R + r values as bytes, in one of two
layouts, and the plain-torch quantize / dequantize that the fused KV write and the decode kernels match. An
FP8 pool's buffer holds these bytes as uint8: a uint8 layer tensor means FP8 rows (`is_fp8`), and its width
tells the layout (`rows_format`)."""

# scales "token" (the Triton FP8 decode kernel's): [c_kv: R float8_e4m3fn codes | k_pe: r bfloat16 | scale:
# float32 | zero pad to 16 bytes] (DeepSeek-V3: 512 + 128 + 4 -> 656 bytes, against 1,152 in bf16).
# c_kv = code * scale, one scale per token: the smallest power of two with max|c_kv| <= 448 * scale, so
# quantizing is an exact scaling plus one rounding and torch and Triton write the same codes. The roped k_pe
# stays 16-bit: rounding it to FP8 costs more accuracy than the latent's (bench/kv_fp8_accuracy.py --formats).
# scales "tensor" (FlashInfer's FP8 MLA decode reads it; vLLM's and SGLang's fp8_e4m3 MLA cache): the whole
# row [c_kv | k_pe] as R + r float8_e4m3fn codes (576 bytes) with one scale for the tensor, 1.0 as theirs
# without calibrated scales, values past +-448 clamped. Less accurate than "token" on the demo model (argmax
# agreement with bf16 94.1 % against 96.5 %, perplexity within 0.1 %; bench/results/kv_fp8_accuracy-cpu.json).

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.engine.args import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
ROPE_DTYPE = torch.bfloat16
FP8_MAX = 448.0
TENSOR_SCALE = 1.0  # the "tensor" layout's scale for c_kv and k_pe alike
SCALES = ("token", "tensor")
_MANT_1_75 = 0x600000  # float32 mantissa bits of 1.75 (448 = 1.75 * 2^8)


def is_fp8(layer_rows: torch.Tensor) -> bool:
    """Whether a pool layer (or rows gathered from it) holds FP8 rows as raw bytes."""
    return layer_rows.dtype == torch.uint8


@dataclass(frozen=True)
class Fp8Rows:
    latent: int  # R: c_kv values, stored as FP8 codes
    rope: int  # r: k_pe values, stored as bfloat16 ("token") or FP8 codes ("tensor")
    scales: str = "token"  # "token": a scale per row; "tensor": one for all rows (TENSOR_SCALE)

    def __post_init__(self) -> None:
        if self.latent < 1 or self.rope < 1 or self.latent % 4 or self.rope % 2:
            raise ValueError(f"FP8 KV rows need R % 4 == 0 and r % 2 == 0, got R={self.latent}, r={self.rope}")
        if self.scales not in SCALES:
            raise ValueError(f"FP8 KV row scales must be one of {SCALES}, got {self.scales!r}")

    @property
    def name(self) -> str:
        """The layout as peers exchanging pages compare it: "fp8_e4m3" (token scales) or "fp8_e4m3_tensor"."""
        return "fp8_e4m3" if self.scales == "token" else "fp8_e4m3_tensor"

    @property
    def rope_offset(self) -> int:
        return self.latent

    @property
    def scale_offset(self) -> int:
        return self.latent + 2 * self.rope

    @property
    def row_bytes(self) -> int:
        if self.scales == "tensor":
            return self.latent + self.rope
        return -(-(self.scale_offset + 4) // 16) * 16

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., R + r] (any float dtype) -> [..., row_bytes] uint8."""
        if rows.shape[-1] != self.latent + self.rope:
            raise ValueError(f"FP8 KV rows take {self.latent + self.rope} values, got {rows.shape[-1]}")
        if self.scales == "tensor":
            return (rows.float() / TENSOR_SCALE).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        lat = rows[..., : self.latent].float()
        scale, inv = pow2_scale(lat.abs().amax(-1))
        out = torch.zeros(*rows.shape[:-1], self.row_bytes, dtype=torch.uint8, device=rows.device)
        out[..., : self.latent] = (lat * inv[..., None]).to(FP8).view(torch.uint8)
        out[..., self.rope_offset : self.scale_offset] = _bytes(rows[..., self.latent :].to(ROPE_DTYPE))
        out[..., self.scale_offset : self.scale_offset + 4] = _bytes(scale[..., None])
        return out

    def dequantize(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """raw [..., row_bytes] uint8 -> rows [..., R + r] in `dtype`."""
        if self.scales == "tensor":
            return (raw.contiguous().view(FP8).float() * TENSOR_SCALE).to(dtype)
        codes = raw[..., : self.latent].contiguous().view(FP8).float()
        scale = raw[..., self.scale_offset : self.scale_offset + 4].contiguous().view(torch.float32)
        rope = raw[..., self.rope_offset : self.scale_offset].contiguous().view(ROPE_DTYPE)
        return torch.cat([(codes * scale).to(dtype), rope.to(dtype)], dim=-1)


def pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row amax (float32) -> (scale, 1 / scale): the smallest power of two with amax <= 448 * scale,
    from the float's bits (exact; the Triton write does the same)."""
    bits = amax.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > _MANT_1_75).to(torch.int32)
    exp = exp.clamp(1, 253)
    return (exp << 23).view(torch.float32), ((254 - exp) << 23).view(torch.float32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def fp8_rows(kv_cache_dtype: str, latent: int, rope: int, scales: str = "token") -> Fp8Rows | None:
    """The row format for a kv_cache_dtype setting: None for "auto" (rows in the model dtype); `scales` picks
    the FP8 layout (the attention backend's: attention_backend.fp8_scales)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return Fp8Rows(latent, rope, scales) if kv_cache_dtype == "fp8_e4m3" else None


def rows_format(raw: torch.Tensor, latent: int, rope: int) -> Fp8Rows:
    """The layout of FP8 rows from their width: R + r bytes is "tensor", anything wider "token"."""
    return Fp8Rows(latent, rope, "tensor" if raw.shape[-1] == latent + rope else "token")


def read_rows(raw_or_rows: torch.Tensor, latent: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a pool layer as values: FP8 rows dequantized into `dtype`, others as they are."""
    if is_fp8(raw_or_rows):
        return rows_format(raw_or_rows, latent, rope).dequantize(raw_or_rows, dtype)
    return raw_or_rows
