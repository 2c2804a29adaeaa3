"""Lower bound on one DeepSeek-V3 (671B) decode step of an EP rank with DP attention.

With an H200's peaks as defaults (HBM 4.27 TB/s, 780 bf16 and 1,399 fp8 TFLOP/s): step >= MLA (max of
KV bytes / HBM and MLA FLOPs / bf16 peak) + GEMMs (max of weight bytes / HBM and GEMM FLOPs / fp8 peak).
"""

from __future__ import annotations

H, L, LD, LM, V = 7168, 61, 3, 58, 129280
HEADS, QR, KVR, NOPE, ROPE, VD = 128, 1536, 512, 128, 64, 128
INTER_DENSE, INTER_MOE, TOPK = 18432, 2048, 8


def decode_step_bound(
    batch: int,
    ctx: float,
    ep: int = 72,
    physical: int = 288,
    kv_bytes: float = 2,
    hbm: float = 4.27e12,
    bf16: float = 780e12,
    fp8: float = 1399e12,
) -> dict[str, float]:
    """Seconds for the step's lower bound and its parts; `tokens_per_s` = batch / bound."""
    attn_params = (
        H * QR + QR * HEADS * (NOPE + ROPE) + H * (KVR + ROPE) + KVR * HEADS * (NOPE + VD) + HEADS * VD * H
    )
    expert = 3 * H * INTER_MOE
    local = physical // ep
    w_bytes = (
        L * attn_params
        + LD * 3 * H * INTER_DENSE
        + LM * (expert * (1 + local))
        + LM * 256 * H * 2
        + V * H * 2
    )
    kv = batch * ctx * L * (KVR + ROPE) * kv_bytes
    mla_flops = batch * L * HEADS * ctx * ((KVR + ROPE) + KVR) * 2
    gemm_flops = batch * (
        L * 2 * attn_params
        + L * HEADS * NOPE * KVR * 2 * 2
        + LD * 2 * 3 * H * INTER_DENSE
        + LM * 2 * expert * (1 + TOPK)
        + 2 * V * H
    )
    t_mla = max(kv / hbm, mla_flops / bf16)
    t_gemm = max(w_bytes / hbm, gemm_flops / fp8)
    t = t_mla + t_gemm
    return {
        "step_s": t,
        "mla_s": t_mla,
        "gemm_s": t_gemm,
        "tokens_per_s": batch / t,
        "weight_bytes": w_bytes,
        "kv_bytes": kv,
        "ep_bytes_per_step": LM * batch * TOPK * H * (1 + 2),
    }
