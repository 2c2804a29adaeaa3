"""bench/decode_rank's accuracy checks and profile, kept apart from the timed step: the configured attention
backend against the Triton MLA kernel, both dense FP8 modes against the dequantized float32 product (and
their times), and one eager step under torch.profiler."""

from __future__ import annotations

from pathlib import Path

import torch

from bench import decode_rank as R
from libs.kernels import fp8_gemm as G
from libs.kernels import fp8_rowwise as RW
from libs.kernels.mla_decode import mla_decode


def check_attention(rank: R.Rank, bt: R.Batch) -> float:
    """Relative difference of the configured attention backend vs the Triton kernel on layer 0."""
    sc = bt.scratch
    sc["q_rope"].normal_()
    q_lat = sc["q_lat"].transpose(0, 1)
    R.attention(rank, bt, 0, rank.layers[0], None, {"attn"})
    ref = mla_decode(q_lat, rank.kv[0], bt.table, bt.seq_lens, R.PAGE, R.SM_SCALE, num_splits=bt.num_splits,
                     cfg=rank.mla_cfg, q_rope=sc["q_rope"])  # fmt: skip
    return float((sc["o_lat"].float() - ref.float()).norm() / ref.float().norm())


def _time_modes(x: torch.Tensor, wt: tuple, rw: tuple) -> dict:
    from bench.harness import bench_ms

    b, (n, k) = x.shape[0], wt[0].shape
    us = {
        "block": 1e3 * bench_ms(lambda: R.linear(x, wt)),
        "rowwise": 1e3 * bench_ms(lambda: RW.linear_rowwise(x, *rw)),
    }
    return {"shape": [b, n, k], "us": us, "TFLOPs": {m: 2 * b * n * k / t / 1e6 for m, t in us.items()}}


def check_dense_fp8(rank: R.Rank, b: int) -> dict:
    """Both dense modes on layer 3's q_a/kv_a, q_b and o_proj at batch b: error against the float32
    product with the dequantized block-scaled weight, for gaussian activations and for activations
    with 1% of channels x30 (LLM hidden states carry such outliers), and for a copy of o_proj whose
    128x128 scales spread 16x within a row (the bench's random scales differ by 10% at most, which
    flatters per-channel requantization); plus each projection's time in both modes (quantization
    of the activation included, do_bench median, L2 flushed)."""
    lw = rank.layers[R.DENSE_LAYERS]
    g = torch.Generator(device=R.DEV).manual_seed(7)
    spread = lw.o_proj[1] * 4.0 ** (2 * torch.rand(lw.o_proj[1].shape, device=R.DEV, generator=g) - 1)
    cases = [
        ("qkv_a", lw.qkv_a),
        ("q_b", lw.q_b),
        ("o_proj", lw.o_proj),
        ("o_proj_spread_scales", (lw.o_proj[0], spread)),
    ]
    out: dict = {"batch": b}
    for name, (w, s) in cases:
        rw = lw.rowwise.get(name) or RW.requant_rowwise(w, s)
        wf = G.dequant_blocks(w, s)
        n, k = w.shape
        for act in ("gaussian", "outliers"):
            x = torch.randn(b, k, device=R.DEV, generator=g)
            if act == "outliers":
                x[:, torch.randperm(k, device=R.DEV, generator=g)[: k // 100]] *= 30
            x = x.to(torch.bfloat16)
            ref = x.float() @ wf.t()
            out[f"{name}/{act}"] = {"block": RW.error_vs_dequantized(R.linear(x, (w, s)), ref),
                                    "rowwise": RW.error_vs_dequantized(RW.linear_rowwise(x, *rw), ref)}  # fmt: skip
        del wf
        if name != "o_proj_spread_scales" and R.DEV == "cuda":
            out[f"{name}/time"] = _time_modes(x, (w, s), rw)
    return out


def profile_step(rank: R.Rank, bt: R.Batch, path: Path) -> None:
    """One eager step under torch.profiler: per-kernel CUDA time, to see what a part is made of."""
    from torch.profiler import ProfilerActivity, profile

    R.decode_step(rank, bt, {"attn", "moe", "other"})
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        R.decode_step(rank, bt, {"attn", "moe", "other"})
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    path.write_text(table)
    print(table[:6000])
