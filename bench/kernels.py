"""Kernel micro-benchmarks on one GPU: MLA decode (Triton, FlashInfer where installed) and the FP8
block-scaled grouped GEMM at DeepGEMM's published MoE shapes.

    python -m bench.kernels [--quick] [--mla-fp8-only]

MLA: FLOPs = B*H*L*(576 + 512)*2 (QK^T over 576 dims, PV over 512); bytes = KV rows read once
(B*L*576*elem) + q + out. With 128 heads (DP attention) the kernel is compute-bound: judge TFLOP/s;
with 16 heads (a TP-8 layout) it is memory-bound: judge GB/s. The tile sweep at B=256, L=2048,
128 heads picks the config used for the rest (and written to mla_best.json for bench.decode_rank).
The FP8 cache (`mla_fp8_suite`): the FP8-dot kernel (libs.kernels.mla_decode_fp8) over FP8 rows (656 bytes a
token) beside FlashInfer's and the Triton bf16 kernel over the same rows dequantized to bf16, in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bench.harness import bench_ms, environment, write_results
from libs.kernels import flashinfer_mla, gemm_tuning
from libs.kernels import fp8_gemm as G
from libs.kernels.mla_decode import MLAConfig, choose_num_splits, mla_decode, mla_decode_reference
from libs.kernels.mla_decode_fp8 import (
    DECODE_DOTS,
    DOTS,
    dequantize_rows,
    mla_decode_fp8,
    mla_decode_fp8_reference,
)
from libs.kernels.quant import quant_fp8_groups

PAGE = 64
SWEEP_128 = [
    MLAConfig(64, n, w, s) for n, w, s in [(64, 8, 2), (64, 16, 2), (128, 8, 1), (64, 8, 3), (128, 16, 1)]
]
SWEEP_16 = [
    MLAConfig(16, n, w, s) for n, w, s in [(128, 4, 2), (128, 4, 3), (256, 8, 2), (256, 4, 2), (128, 8, 2)]
]


def mla_inputs(b, h, ctx, kv_dtype=torch.bfloat16, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-ctx // PAGE)
    kv = torch.randn(b * pages * PAGE, 576, device=device, generator=g, dtype=torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        kv = (kv / 4).to(kv_dtype)
    table = torch.randperm(b * pages, device=device, generator=g).view(b, pages).int()
    q = torch.randn(b, h, 576, device=device, generator=g, dtype=torch.bfloat16)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=device)
    return q, kv, table, seq


def mla_record(b, h, ctx, ms, kv_dtype, backend, cfg=None, splits=None, row_bytes=None):
    flops = b * h * ctx * (576 + 512) * 2
    row_bytes = row_bytes or 576 * torch.empty(0, dtype=kv_dtype).element_size()
    byts = b * ctx * row_bytes + b * h * (576 + 512) * 2
    return {
        "benchmark": "mla_decode", "backend": backend, "batch": b, "ctx": ctx, "heads": h,
        "kv_dtype": str(kv_dtype).removeprefix("torch."), "ms": ms, "TFLOPs": flops / ms / 1e9,
        "GBps": byts / ms / 1e6, "config": asdict(cfg) if cfg else None, "num_splits": splits,
    }  # fmt: skip


def time_mla(q, kv, table, seq, cfg, splits, kv_scale=1.0):
    def run():
        mla_decode(q, kv, table, seq, PAGE, 0.1352, num_splits=splits, cfg=cfg, kv_scale=kv_scale)

    return bench_ms(run)


def sweep(b, h, ctx, configs, log):
    q, kv, table, seq = mla_inputs(b, h, ctx)
    ref = mla_decode_reference(q[:4], kv, table[:4], seq[:4], PAGE, 0.1352)
    best = None
    for cfg in configs:
        splits = choose_num_splits(b, h, ctx, cfg)
        try:
            out = mla_decode(q, kv, table, seq, PAGE, 0.1352, num_splits=splits, cfg=cfg)
            err = _rel_err(out[:4], ref)
            ms = time_mla(q, kv, table, seq, cfg, splits)
        except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
            log(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        rec = mla_record(b, h, ctx, ms, torch.bfloat16, "triton-sweep", cfg, splits)
        log(
            f"  {cfg} splits={splits}: {ms * 1e3:.0f} us {rec['TFLOPs']:.0f} TFLOP/s {rec['GBps']:.0f} GB/s err {err:.1e}"
        )
        if err < 1e-2 and (best is None or ms < best[1]):
            best = (cfg, ms)
    return best[0]


def mla_suite(batches, ctxs, log) -> list[dict]:
    records = []
    best = {128: sweep(256, 128, 2048, SWEEP_128, log), 16: sweep(256, 16, 8192, SWEEP_16, log)}
    out_dir = Path(os.environ.get("OUT") or "bench/results")
    (out_dir / "mla_best.json").write_text(json.dumps({str(k): asdict(v) for k, v in best.items()}))
    fi = flashinfer_mla.FlashInferMLA("cuda") if flashinfer_mla.available() else None
    for h in (128, 16):
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for b in batches:
                for ctx in ctxs:
                    q, kv, table, seq = mla_inputs(b, h, ctx, kv_dtype)
                    cfg = best[h]
                    auto = choose_num_splits(b, h, ctx, cfg)
                    tried = {
                        s: time_mla(q, kv, table, seq, cfg, s, 4.0)
                        for s in sorted({auto, 2 * auto, 4 * auto})
                    }
                    splits = min(tried, key=tried.get)
                    rec = mla_record(b, h, ctx, tried[splits], kv_dtype, "triton", cfg, splits)
                    rec["ms_auto_splits"] = tried[auto]
                    records.append(rec)
                    log(f"mla h={h} {rec['kv_dtype']} B={b} L={ctx}: {rec['ms'] * 1e3:.0f} us "
                        f"{rec['TFLOPs']:.0f} TFLOP/s {rec['GBps']:.0f} GB/s (splits {splits}; auto {auto}: {tried[auto] * 1e3:.0f} us)")  # fmt: skip
                    if fi is not None and kv_dtype == torch.bfloat16:
                        fi.plan(table, seq, PAGE, h, 0.1352)
                        ms = bench_ms(lambda q=q, kv=kv: fi.run(q[..., :512], q[..., 512:], kv))
                        ref = mla_decode(q, kv, table, seq, PAGE, 0.1352, num_splits=splits, cfg=cfg)
                        got = fi.run(q[..., :512], q[..., 512:], kv)
                        err = _rel_err(got, ref)
                        rec = mla_record(b, h, ctx, ms, kv_dtype, "flashinfer-fa3")
                        rec["rel_err_vs_triton"] = err
                        records.append(rec)
                        log(
                            f"  flashinfer fa3: {ms * 1e3:.0f} us {rec['TFLOPs']:.0f} TFLOP/s {rec['GBps']:.0f} GB/s"
                        )
    return records


FP8_SWEEP = [MLAConfig(bh, n, w, s) for bh, n, w, s in [
    (64, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (64, 128, 8, 1), (32, 64, 4, 2),
]]  # fmt: skip


def mla_fp8_suite(shapes, log, sweep=FP8_SWEEP, dots_modes=DOTS, fi_fp8=True) -> list[dict]:
    """Per (B, L, H): FlashInfer (bf16 rows and "tensor" FP8 rows), the Triton bf16 kernel (same rows) and the
    FP8-dot kernel over the "token" FP8 rows those came from, each error against float attention over the
    same values; FP8 configs swept for each of `dots_modes` (an empty sweep: no Triton FP8 kernel); fi_fp8:
    FlashInfer's FP8 decode too."""
    fi = flashinfer_mla.FlashInferMLA("cuda") if flashinfer_mla.available() else None
    records: list[dict] = []
    for b, ctx, h in shapes:
        records += mla_fp8_case(b, ctx, h, fi, log, sweep=sweep, dots_modes=dots_modes, fi_fp8=fi_fp8)
    return records


def quantize_rows(fmt, kv: torch.Tensor) -> torch.Tensor:
    """kv [slots, R + r] as FP8 rows of `fmt`, a chunk at a time (bounded temporaries)."""
    out = torch.empty(kv.shape[0], fmt.row_bytes, dtype=torch.uint8, device=kv.device)
    for s in range(0, kv.shape[0], 1 << 18):
        out[s : s + (1 << 18)] = fmt.quantize(kv[s : s + (1 << 18)])
    return out


def mla_fp8_case(b, ctx, h, fi, log, device="cuda", sweep=FP8_SWEEP, dots_modes=DOTS, fi_fp8=True) -> list[dict]:
    from libs.engine.kv_fp8 import Fp8Rows

    fmt, records = Fp8Rows(512, 64), []
    q, kv, table, seq = mla_inputs(b, h, ctx, device=device)
    rows8 = quantize_rows(fmt, kv)
    kv16 = dequantize_rows(rows8).to(torch.bfloat16)  # the same values as bf16 rows
    ql, qr = q[..., :512], q[..., 512:]
    exact = mla_decode_reference(q[:4].float(), kv16.float(), table[:4], seq[:4], PAGE, 0.1352)
    ref8 = mla_decode_fp8_reference(ql[:4], qr[:4], rows8, table[:4], seq[:4], PAGE, 0.1352)

    def err(out, ref=exact):
        return _rel_err(out[:4], ref)

    def fi_run():
        return fi.run(ql, qr, kv16)

    cfg16 = MLAConfig()
    s16 = choose_num_splits(b, h, ctx, cfg16)

    def bf16_run():
        return mla_decode(q, kv16, table, seq, PAGE, 0.1352, num_splits=s16, cfg=cfg16)

    base = {}
    if fi is not None:
        fi.plan(table, seq, PAGE, h, 0.1352)
        base["flashinfer-fa3"] = ms = bench_ms(fi_run)
        rec = mla_record(b, h, ctx, ms, torch.bfloat16, "flashinfer-fa3")
        records.append({**rec, "rel_err_vs_exact": err(fi_run()), "kv_cache": "bf16"})
    if fi is not None and fi_fp8:
        tensor = Fp8Rows(512, 64, "tensor")  # FlashInfer's FP8 decode over "tensor" rows of the same values
        rows_t = quantize_rows(tensor, kv)
        exact_t = mla_decode_reference(q[:4].float(), tensor.dequantize(rows_t, torch.float32), table[:4], seq[:4],
                                       PAGE, 0.1352)  # fmt: skip
        fi8 = flashinfer_mla.FlashInferMLA(device, workspace=fi.workspace)
        fi8.plan(table, seq, PAGE, h, 0.1352, torch.bfloat16, torch.float8_e4m3fn)

        def fi8_run():
            return fi8.run(ql, qr, rows_t)

        ms = bench_ms(fi8_run)
        out = fi8_run()
        rec = mla_record(b, h, ctx, ms, torch.uint8, "flashinfer-fa3-fp8-tensor-rows", row_bytes=tensor.row_bytes)
        records.append({**rec, "rel_err_vs_exact": err(out, exact_t), "rel_err_vs_bf16_rows": err(out),
                        "kv_cache": "fp8_e4m3_tensor", "speedup_vs_flashinfer-fa3": base["flashinfer-fa3"] / ms})  # fmt: skip
        log(f"flashinfer fa3 fp8 tensor rows h={h} B={b} L={ctx}: {ms * 1e3:.0f} us {rec['TFLOPs']:.0f} TFLOP/s, "
            f"err {err(out, exact_t):.1e} ({base['flashinfer-fa3'] / ms:.2f}x its bf16)")  # fmt: skip
    base["triton-bf16"] = ms = bench_ms(bf16_run)
    records.append({**mla_record(b, h, ctx, ms, torch.bfloat16, "triton-bf16", cfg16, s16),
                    "rel_err_vs_exact": err(bf16_run()), "kv_cache": "bf16"})  # fmt: skip
    narrow = dataclasses.replace(cfg16, block_n=32)  # 32-row tiles too (their spills: bench.kernel_resources)
    s32 = choose_num_splits(b, h, ctx, narrow)

    def narrow_run():
        return mla_decode(q, kv16, table, seq, PAGE, 0.1352, num_splits=s32, cfg=narrow)

    ms = bench_ms(narrow_run)
    records.append({**mla_record(b, h, ctx, ms, torch.bfloat16, "triton-bf16", narrow, s32), "sweep": True,
                    "rel_err_vs_exact": err(narrow_run()), "kv_cache": "bf16"})  # fmt: skip
    log(f"triton-bf16 {narrow} h={h} B={b} L={ctx}: {ms * 1e3:.0f} us (64x64: {base['triton-bf16'] * 1e3:.0f} us)")
    records += sm90_fp8_variants(b, ctx, h, ql, qr, rows8, table, seq, err, ref8, base, log)
    for dots in dots_modes:
        best = None
        for cfg in sweep:
            if h % min(cfg.block_h, max(16, h)):
                continue
            auto = choose_num_splits(b, h, ctx, cfg)
            for splits in sorted({auto, 2 * auto}):
                run = functools.partial(
                    mla_decode_fp8, ql, rows8, table, seq, PAGE, 0.1352, q_rope=qr, num_splits=splits, cfg=cfg,
                    dots=dots,
                )  # fmt: skip
                try:
                    out = run()
                    ms = bench_ms(run)
                except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
                    log(f"  fp8 rows, {dots} dots, {cfg} splits={splits}: failed {type(e).__name__}: {str(e)[:120]}")
                    continue
                rec = {**mla_record(b, h, ctx, ms, torch.uint8, f"triton-{dots}-dots", cfg, splits, fmt.row_bytes),
                       "rel_err_vs_exact": err(out), "rel_err_vs_q8_reference": err(out, ref8),
                       "kv_cache": "fp8_e4m3", "dots": dots, "sweep": True}  # fmt: skip
                log(f"  fp8 rows, {dots} dots, {cfg} splits={splits}: {ms * 1e3:.0f} us {rec['TFLOPs']:.0f} TFLOP/s "
                    f"err {rec['rel_err_vs_exact']:.1e}")  # fmt: skip
                records.append(rec)
                if rec["rel_err_vs_exact"] < 8e-2 and (best is None or ms < best["ms"]):
                    best = rec
        if best is not None:
            records.append(best_record(best, base, f"{dots} dots", log))
    return records


def best_record(best: dict, base: dict, label: str, log) -> dict:
    """A sweep's fastest record as the one to quote, with its speed-ups over `base`'s kernels, logged."""
    best = {**best, "sweep": False, **{f"speedup_vs_{k}": v / best["ms"] for k, v in base.items()}}
    log(f"mla fp8 rows, {label}, h={best['heads']} B={best['batch']} L={best['ctx']}: {best['ms'] * 1e3:.0f} us "
        f"{best['TFLOPs']:.0f} TFLOP/s, err {best['rel_err_vs_exact']:.1e}; "
        + ", ".join(f"{k} {v * 1e3:.0f} us ({v / best['ms']:.2f}x)" for k, v in base.items()))  # fmt: skip
    return best


def sm90_fp8_variants(b, ctx, h, ql, qr, rows8, table, seq, err, ref8, base, log) -> list[dict]:
    """The Gluon SM90 FP8 decode's schedules (libs.kernels.mla_decode_fp8_sm90, pipelined; its warp-specialized
    seesaw, mla_decode_fp8_sm90_seesaw) at the Engine's split count and twice it, each checked against the
    references, the fastest beside `base`'s kernels."""
    from libs.kernels import mla_decode_fp8_sm90 as sm90
    from libs.kernels import mla_decode_fp8_sm90_seesaw as seesaw

    if not sm90.available(ql.device, PAGE, h):
        return []
    records, best = [], None
    auto = choose_num_splits(b, h, ctx, MLAConfig())  # the Engine's split count (64 heads x 64 rows a tile)
    schedules = {"pipelined": (sm90.mla_decode_fp8_sm90, "gluon-sm90-fp8-dots", sm90.STAGES),
                 "seesaw": (seesaw.mla_decode_fp8_sm90_seesaw, "gluon-sm90-seesaw-fp8-dots", seesaw.STAGES)}  # fmt: skip
    for (schedule, (fn, name, stages)), splits in itertools.product(schedules.items(), sorted({auto, 2 * auto})):
        run = functools.partial(fn, ql, rows8, table, seq, PAGE, 0.1352, q_rope=qr, num_splits=splits)
        try:
            out = run()
        except Exception as e:  # noqa: BLE001 - a schedule that does not build here is reported, the rest still run
            log(f"  gluon sm90 fp8 rows {schedule} splits={splits}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        ms = bench_ms(run)
        rec = {**mla_record(b, h, ctx, ms, torch.uint8, name, None, splits, rows8.shape[1]),
               "num_stages": stages, "schedule": schedule, "rel_err_vs_exact": err(out),
               "rel_err_vs_q8_reference": err(out, ref8), "kv_cache": "fp8_e4m3", "dots": "fp8", "sweep": True}  # fmt: skip
        log(f"  gluon sm90 fp8 rows {schedule} splits={splits}: {ms * 1e3:.0f} us "
            f"{rec['TFLOPs']:.0f} TFLOP/s err {rec['rel_err_vs_exact']:.1e} (vs q8 reference "
            f"{rec['rel_err_vs_q8_reference']:.1e})")  # fmt: skip
        records.append(rec)
        if best is None or ms < best["ms"]:
            best = rec
    if best is not None:
        records.append(best_record(best, base, "gluon sm90", log))
    return records


def gemm_inputs(e, m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(e, m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, xs = quant_fp8_groups(x)
    w = torch.randn(e, n, k, device="cuda", generator=g, dtype=torch.bfloat16).to(G.FP8)
    ws = torch.rand(e, -(-n // 128), k // 128, device="cuda", generator=g) * 0.01 + 0.001
    return xq, xs, w, ws


def gemm_case(e, m, n, k, log) -> list[dict]:
    xq, xs, w, ws = gemm_inputs(e, m, n, k)
    counts = torch.full((e,), m, dtype=torch.int32, device="cuda")
    out = G.fp8_gemm_masked(xq, xs, w, ws, counts)
    ref = G.fp8_gemm_reference(xq[0], xs[0], w[0], ws[0])
    err = _rel_err(out[0], ref)
    flops = 2 * e * m * n * k
    variants = {"masked-chosen": lambda: G.fp8_gemm_masked(xq, xs, w, ws, counts, out=out)}
    flat_q, flat_s = xq.view(e * m, k), xs.view(e * m, k // 128)
    for bm in (64, 128):
        te = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(m // bm)
        variants[f"contiguous-bm{bm}"] = lambda te=te, bm=bm: G.fp8_gemm_contiguous(
            flat_q, flat_s, w, ws, te, bm
        )
    variants["dense-one-expert"] = lambda: G.fp8_gemm(xq[0], xs[0], w[0], ws[0])  # split-K measured per shape
    variants["dense-one-expert-nosplit"] = lambda: G.fp8_gemm(xq[0], xs[0], w[0], ws[0], split_k=1)
    variants.update(sm90_variants(xq, xs, w, ws, counts, out))
    records = []
    for name, fn in variants.items():
        fn()
        if name.startswith(("sm90-", "sm90ws-")):  # each Gluon config checked against the reference, not just timed
            got = out[0] if "masked" in name else fn()
            err = _rel_err(got, ref)
        ms = gemm_tuning.graph_time(fn)  # graph-replayed: eager timing of ~100 us kernels times the launch
        f = flops / e if "dense" in name else flops
        cfg = None
        if name == "masked-chosen":
            cfg = chosen_kernel(G.MASKED, m, n, k, e)
        elif name == "dense-one-expert-nosplit":
            cfg = chosen_kernel(G.DENSE, m, n, k, 1)
        elif name == "dense-one-expert":
            split = G._SPLIT_CHOICE.get(("split", *G.tuning_key(G.DENSE, m, n, k, 1)), 1)  # timed fastest
            if split == 1:
                cfg = f"split_k=1 {chosen_kernel(G.DENSE, m, n, k, 1)}"
            else:  # _fp8_gemm_split_k: Gluon slices where it has a config, else Triton's 64x128 tiles
                split_cfg = G._split_sm90_config(xq[0], w[0], split)
                cfg = f"split_k={split} " + (f"sm90 {split_cfg}" if split_cfg else "triton 64x128")
        records.append({"benchmark": "moe_gemm", "variant": name, "experts": e, "tokens_per_expert": m,
                        "N": n, "K": k, "ms": ms, "TFLOPs": f / ms / 1e9, "rel_err": err, "config": cfg})  # fmt: skip
        log(
            f"gemm {name} {e}x{m} N={n} K={k}: {ms * 1e3:.1f} us {f / ms / 1e9:.0f} TFLOP/s (err {err:.1e}) {cfg or ''}"
        )
    return records


def chosen_kernel(layout, m, n, k, e) -> str:
    """What `fp8_gemm._choose` runs for this shape: a Gluon config, or the Triton kernel with its tuned config."""
    key = G.tuning_key(layout, m, n, k, e)
    cfg = G._KERNEL_CHOICE.get(key)
    return f"sm90 {cfg}" if cfg is not None else f"triton {G._TRITON_CONFIG.get(key)}"


def sm90_variants(xq, xs, w, ws, counts, out) -> dict:
    """Every Gluon WGMMA config (libs.kernels.fp8_gemm_sm90) on the masked layout and on expert 0 as a
    dense GEMM, where the shape allows it."""
    from libs.kernels import fp8_gemm_sm90 as S

    if not S.available(xq.device):
        return {}
    e, m, k = xq.shape
    n = w.shape[1]
    dense_out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    variants = {}
    for cfg in S.CONFIGS:
        if (k // 128) % cfg[4] or n % cfg[1]:
            continue
        tag = "-".join(map(str, cfg))
        variants[f"sm90-masked-{tag}"] = lambda cfg=cfg: G._launch_sm90(
            xq, xs, w, ws, out, m, counts, counts, G.MASKED, e, cfg
        )
        variants[f"sm90-dense-{tag}"] = lambda cfg=cfg: (
            G._launch_sm90(xq[:1], xs[:1], w[:1], ws[:1], dense_out[None], m, xs, xs, G.DENSE, 1, cfg),
            dense_out,
        )[1]
    variants.update(sm90_ws_variants(xq, xs, w, ws, counts, out))
    return variants


def sm90_ws_variants(xq, xs, w, ws, counts, out) -> dict:
    """The persistent warp-specialized Gluon GEMM's configs (libs.kernels.fp8_gemm_sm90_ws) on the masked layout."""
    from libs.kernels import fp8_gemm_sm90_ws as WS

    e, m, k = xq.shape
    n = w.shape[1]
    variants = {}
    for cfg in WS.CONFIGS:
        if (k // 128) % cfg[2] or n % cfg[0]:
            continue
        variants["sm90ws-masked-" + "-".join(map(str, cfg))] = lambda cfg=cfg: WS.launch(
            xq.reshape(-1, k), xs, w.reshape(e * n, k), ws, out, m, n, k, counts, counts, G.MASKED, e, cfg,
            a_rows_per_expert=m, group_m=G.group_m_for(128),
        )  # fmt: skip
    return variants


def gemm_suite(log) -> list[dict]:
    records = []
    for e, m, n, k in [
        (4, 256, 4096, 7168),
        (4, 256, 7168, 2048),
        (4, 512, 4096, 7168),
        (4, 512, 7168, 2048),
        (1, 256, 7168, 16384),  # o_proj at B=256
        (1, 256, 2112, 7168),  # fused q_a/kv_a at B=256
        (1, 256, 24576, 1536),  # q_b at B=256
    ]:
        with gemm_tuning.tuning(tempfile.mkdtemp(prefix="kernels-tuning-")):  # fastest kernels, timed
            records += gemm_case(e, m, n, k, log)
    choices = {str(key): str(cfg) for key, cfg in G._KERNEL_CHOICE.items()}
    log(f"kernel choices (layout, m bucket, n, k, experts) -> config (None: Triton): {choices}")
    records.append({"benchmark": "fp8_gemm_choice", "choices": choices,
                    "timings_ms": {str(key): t for key, t in gemm_tuning.TIMINGS.items()},
                    "rejected": {str(key): v for key, v in gemm_tuning.REJECTED.items()}})  # fmt: skip
    return records


PREFILL_GEMMS = [  # (experts, rows per expert, N, K): a prefill rank's 4k-token forward (EP-32: 8 routed + shared)
    (9, 4096, 4096, 7168),  # MoE gate/up, contiguous
    (9, 4096, 7168, 2048),  # MoE down, contiguous
    (1, 4096, 7168, 16384),  # o_proj
    (1, 4096, 24576, 1536),  # q_b
    (1, 4096, 2112, 7168),  # fused q_a / kv_a
]


def prefill_gemm_suite(log, group_ms=(1, None)) -> list[dict]:
    """Prefill's FP8 GEMMs at a 4k-token forward's shapes, each Gluon config over program groups of group_ms
    row tiles (None: the kernels' default, fp8_gemm.group_m_for; 1: every column tile of one row tile in
    turn) in one run, beside the Triton kernel and what the tuning table chooses. Contiguous cases lay each
    expert's rows out as tiles of the config's height."""
    records = []
    for e, m, n, k in PREFILL_GEMMS:
        records += _prefill_gemm_case(e, m, n, k, group_ms, log)
        torch.cuda.empty_cache()
    return records


def _prefill_gemm_case(e, m, n, k, group_ms, log) -> list[dict]:
    from libs.kernels import fp8_gemm_sm90 as S

    xq, xs, w, ws = gemm_inputs(e, m, n, k)
    flat_q, flat_s = xq.view(e * m, k), xs.view(e * m, k // 128)
    out = torch.empty(e * m, n, dtype=torch.bfloat16, device="cuda")
    ref = torch.cat([G.fp8_gemm_reference(flat_q[i * m : (i + 1) * m], flat_s[i * m : (i + 1) * m], w[i], ws[i])
                     for i in range(e)])  # fmt: skip
    layout = G.CONTIGUOUS if e > 1 else G.DENSE

    def tiles(bm):  # each expert's rows as tiles of bm rows
        return torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(m // bm)

    variants = {}
    for cfg in S.CONFIGS if S.available(xq.device) else []:
        if (k // 128) % cfg[4] or n % cfg[1]:
            continue
        for g in group_ms:
            variants[(cfg, g)] = lambda cfg=cfg, g=g, te=tiles(cfg[0]): S.launch(
                flat_q, flat_s[None], w.reshape(e * n, k), ws, out[None], e * m, n, k, te, te, layout, 1, cfg,
                group_m=g or G.group_m_for(cfg[0]),
            )  # fmt: skip
    if S.available(xq.device):  # the persistent warp-specialized kernel: 128-row tiles
        from libs.kernels import fp8_gemm_sm90_ws as WS

        for cfg in WS.CONFIGS:
            if (k // 128) % cfg[2] or n % cfg[0]:
                continue
            variants[("sm90ws-" + "-".join(map(str, cfg)), None)] = lambda cfg=cfg, te=tiles(128): WS.launch(
                flat_q, flat_s[None], w.reshape(e * n, k), ws, out[None], e * m, n, k, te, te, layout, 1, cfg,
                group_m=G.group_m_for(128),
            )  # fmt: skip
    te64 = tiles(64)
    if e > 1:
        variants[("triton-bm64", None)] = lambda: G._launch_triton(
            flat_q[None], flat_s[None], w, ws, out[None], e * m, te64, te64, G.CONTIGUOUS, 1, 64
        )
        variants[("chosen-bm64", None)] = lambda: G.fp8_gemm_contiguous(flat_q, flat_s, w, ws, te64, 64, out=out)
    else:
        variants[("chosen", None)] = lambda: G.fp8_gemm(flat_q, flat_s, w[0], ws[0], out=out)
    flops = 2 * e * m * n * k
    records = []
    for (cfg, g), fn in variants.items():
        out.fill_(float("nan"))  # every row must be this variant's own (a tile it skipped stays NaN)
        fn()
        err = _rel_err(out, ref)
        ms = gemm_tuning.graph_time(fn)
        name = cfg if isinstance(cfg, str) else "sm90-" + "-".join(map(str, cfg))
        group = g or (G.group_m_for(cfg[0]) if not isinstance(cfg, str) else None)
        records.append({"benchmark": "prefill_gemm", "variant": name, "group_m": group, "experts": e,
                        "rows_per_expert": m, "N": n, "K": k, "ms": ms, "TFLOPs": flops / ms / 1e9,
                        "rel_err": err})  # fmt: skip
        log(f"prefill gemm {name} group_m={group} {e}x{m} N={n} K={k}: {ms * 1e3:.0f} us "
            f"{flops / ms / 1e9:.0f} TFLOP/s (err {err:.1e})")  # fmt: skip
    return records


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of got against ref, in float32."""
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer MLA shapes (FP8: B=256, L=2048, 128 heads only)")
    ap.add_argument("--skip-mla", action="store_true")
    ap.add_argument("--mla-fp8-only", action="store_true", help="only the FP8-cache MLA comparison")
    ap.add_argument("--triton-fp8", choices=["sweep", "engine", "none"], default="sweep",
                    help="the Triton FP8-cache kernel: every dots mode over the tile sweep, only what the Engine runs "
                    "(its dots mode and tile), or none")  # fmt: skip
    ap.add_argument("--no-triton-fp8", action="store_true", help="as --triton-fp8 none")
    ap.add_argument("--skip-flashinfer-fp8", action="store_true", help="FlashInfer's bf16 decode only (no FP8 one)")
    ap.add_argument("--prefill-gemms", action="store_true",
                    help="only prefill's FP8 GEMMs at a 4k-token forward's shapes, every Gluon config and program "
                    "grouping")  # fmt: skip
    a = ap.parse_args()
    env = environment()
    print(env, flush=True)

    def log(s):
        print(s, flush=True)

    records = []
    fp8_shapes = [(256, 2048, 128), (512, 2048, 128), (128, 8192, 128), (256, 8192, 16)]
    if a.prefill_gemms:
        records += prefill_gemm_suite(log)
    elif a.mla_fp8_only:
        mode = "none" if a.no_triton_fp8 else a.triton_fp8
        sweep = {"sweep": FP8_SWEEP, "engine": [MLAConfig()], "none": []}[mode]
        dots_modes = (DECODE_DOTS,) if mode == "engine" else DOTS
        records += mla_fp8_suite(fp8_shapes[:1] if a.quick else fp8_shapes, log, sweep, dots_modes,
                                 fi_fp8=not a.skip_flashinfer_fp8)
    else:
        records += gemm_suite(log)
    if not a.skip_mla and not a.mla_fp8_only and not a.prefill_gemms:
        records += mla_suite([32, 128, 256] if not a.quick else [256], [2048, 8192], log)
        records += mla_fp8_suite(fp8_shapes[:1] if a.quick else fp8_shapes, log)
    for r in records:
        r.update(env)
    print("wrote", write_results("kernels", records))


if __name__ == "__main__":
    main()
