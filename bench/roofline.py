"""Lower bound on one DeepSeek-V3 (671B) decode step of an EP rank with DP attention.

With an H200's peaks as defaults (HBM 4.27 TB/s, 780 bf16 and 1,399 fp8 TFLOP/s): step >= MLA (max of
KV bytes / HBM and MLA FLOPs / bf16 peak) + GEMMs (max of weight bytes / HBM and GEMM FLOPs / fp8 peak).
"""

from __future__ import annotations

H, L, LD, LM, V = 7168, 61, 3, 58, 129280
HEADS, QR, KVR, NOPE, ROPE, VD = 128, 1536, 512, 128, 64, 128
INTER_DENSE, INTER_MOE, TOPK = 18432, 2048, 8


# H200 peaks: measured on the lent machines (shared/machines notes, 2026-11-30) and NVIDIA's spec sheet.
PEAKS = {
    "measured": {"hbm": 4.27e12, "bf16": 780e12, "fp8": 1399e12},
    "spec": {"hbm": 4.8e12, "bf16": 989e12, "fp8": 1979e12},
}


def decode_step_bound(
    batch: int,
    ctx: float,
    ep: int = 72,
    physical: int = 288,
    kv_bytes: float = 2,
    layers: int = L,
    peaks: str = "measured",
    mla_fp8: bool = False,
) -> dict[str, float]:
    """Seconds for the step's lower bound and its parts; `tokens_per_s` = batch / bound. layers: a model cut
    to fewer layers (its first LD stay dense); peaks: "measured" or "spec" (PEAKS); mla_fp8: attention's dots
    at the FP8 peak (an FP8 KV cache; pass its kv_bytes per value too)."""
    hbm, bf16, fp8 = (PEAKS[peaks][k] for k in ("hbm", "bf16", "fp8"))
    ld = min(LD, layers)
    lm = layers - ld
    # attn_params counts kv_b_proj once: in absorbed decode it is W_UK (q side) and W_UV (output side),
    # H * N * R + H * R * V, the same multiply-adds per token as kv_b as a GEMM.
    attn_params = (
        H * QR + QR * HEADS * (NOPE + ROPE) + H * (KVR + ROPE) + KVR * HEADS * (NOPE + VD) + HEADS * VD * H
    )
    expert = 3 * H * INTER_MOE
    local = physical // ep
    w_bytes = (
        layers * attn_params
        + ld * 3 * H * INTER_DENSE
        + lm * (expert * (1 + local))
        + lm * 256 * H * 2
        + V * H * 2
    )
    kv = batch * ctx * layers * (KVR + ROPE) * kv_bytes
    mla_flops = batch * layers * HEADS * ctx * ((KVR + ROPE) + KVR) * 2
    gemm_flops = batch * (
        layers * 2 * attn_params + ld * 2 * 3 * H * INTER_DENSE + lm * 2 * expert * (1 + TOPK) + 2 * V * H
    )
    t_mla = max(kv / hbm, mla_flops / (fp8 if mla_fp8 else bf16))
    t_gemm = max(w_bytes / hbm, gemm_flops / fp8)
    t = t_mla + t_gemm
    return {
        "step_s": t,
        "mla_s": t_mla,
        "gemm_s": t_gemm,
        "tokens_per_s": batch / t,
        "weight_bytes": w_bytes,
        "kv_bytes": kv,
        "ep_bytes_per_step": lm * batch * TOPK * H * (1 + 2),
    }


def prefill_bound(tokens: int, prompt_len: int, ep: int = 32, peaks: str = "measured") -> dict[str, float]:
    """Seconds for a lower bound on prefilling `tokens` prompt tokens (prompts of prompt_len) on one EP rank
    with DP attention: the GEMMs' FLOPs at the FP8 peak plus causal MLA (expanded form, keys N + r = 192,
    values V = 128) at the bf16 peak. Compute-bound at these sizes; weights are read once per forward."""
    _, bf16, fp8 = (PEAKS[peaks][k] for k in ("hbm", "bf16", "fp8"))
    attn_params = (
        H * QR + QR * HEADS * (NOPE + ROPE) + H * (KVR + ROPE) + KVR * HEADS * (NOPE + VD) + HEADS * VD * H
    )
    per_token_gemm = 2 * (
        L * attn_params + LD * 3 * H * INTER_DENSE + LM * 3 * H * INTER_MOE * (TOPK + 1) + LM * 256 * H
    )
    mean_ctx = (prompt_len + 1) / 2
    per_token_attn = 2 * L * HEADS * mean_ctx * ((NOPE + ROPE) + VD)
    t_gemm, t_attn = tokens * per_token_gemm / fp8, tokens * per_token_attn / bf16
    return {
        "step_s": t_gemm + t_attn,
        "gemm_s": t_gemm,
        "attn_s": t_attn,
        "tokens_per_s": tokens / (t_gemm + t_attn),
    }
