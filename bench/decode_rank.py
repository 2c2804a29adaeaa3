"""One EP rank of a DeepSeek-V3 671B decode deployment on one GPU: the full decode step of the rank's
DP-attention batch, with random FP8 weights, timed with CUDA graphs.

    python -m bench.decode_rank --batch 64,128,256,512 [--ctx 2000 --gen 100] [--world 2]
        [--dense-fp8 block|rowwise|block,rowwise]

What the step does (every layer, as a real engine step): embedding; fused residual-add + RMSNorm;
fused q_a/kv_a FP8 projection; q/kv latent norms; q_b projection; absorbed W_UK (bf16 bmm); RoPE
on q_pe/k_pe with the new latent row normed and written into the paged KV cache (one kernel); Triton MLA decode over the
pages; W_UV bmm; o_proj (its input quantized straight from the per-head bmm output); then the dense MLP
(first 3 layers) or the MoE: bf16 router GEMM, fused noaux_tc top-8 routing (which also appends the
shared expert as a 9th pair), 1x128 FP8 quantization, token permutation into the masked
[local experts, M_max, D] layout (the copy an EP dispatch lands), grouped FP8 gate/up, fused
SwiGLU+quant, grouped FP8 down, weighted combine; final norm, LM head, one-pass Gumbel-max sampling
(temperature 0.7, libs.kernels.sampling).

EP-72 with 288 physical experts: 4 local experts; a balanced deployment sends this rank 8*B token-
expert pairs per MoE layer (the rank's own B tokens x top-8, mapped onto its 4 experts, stand in
for them). Contexts: L prompt tokens plus a uniform 0..gen generated so far (mean L + gen/2).

Breakdown: the step is also captured with only the attention kernel ("attention"), only the MoE
block of the 58 MoE layers ("moe": router .. combine, shared expert included); "other" = full - both.
--dense-fp8 rowwise runs the dense projections (q_a/kv_a, q_b, o_proj, dense MLPs, a separate shared
expert) as per-token x per-channel FP8 through torch._scaled_mm, on weights requantized at load from
the 128x128 block scales (libs.kernels.fp8_rowwise): an accuracy trade, recorded as `dense_fp8` in
each record, with the projections' errors against the dequantized reference measured in the same run.
The MoE grouped GEMMs stay block-scaled. `block,rowwise` keeps both weight sets and measures each
batch in both modes back to back.
With --world 2 (two GPUs) each MoE layer also moves this rank's dispatch (fp8) and combine (bf16)
bytes of an EP-72 deployment to the other GPU with NCCL all_to_all, and the step is reported with
and without that traffic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import environment, graph_ms, write_results
from bench.roofline import decode_step_bound
from libs.kernels import fp8_gemm as G
from libs.kernels import fp8_rowwise as RW
from libs.kernels import fused, moe_ops, quant, routing, sampling
from libs.kernels.mla_decode import MLAConfig, choose_num_splits, mla_decode

D, QR, KVR, NOPE, ROPE, VD, HEADS = 7168, 1536, 512, 128, 64, 128, 128
LAYERS, DENSE_LAYERS, INTER_DENSE, INTER_MOE, EXPERTS, TOPK, VOCAB = 61, 3, 18432, 2048, 256, 8, 129280
N_GROUP, TOPK_GROUP, SCALING, EPS = 8, 4, 2.5, 1e-6
PAGE = 64
DEV = "cuda"
SM_SCALE = 1.0 / math.sqrt(NOPE + ROPE)


def fp8_weight(n: int, k: int, e: int | None = None):
    shape = (n, k) if e is None else (e, n, k)
    w = torch.randn(*shape, device=DEV, dtype=torch.bfloat16).to(G.FP8)
    s_shape = (math.ceil(n / 128), k // 128) if e is None else (e, math.ceil(n / 128), k // 128)
    return w, torch.full(s_shape, 1.0 / math.sqrt(k), device=DEV) * (
        1 + 0.1 * torch.rand(s_shape, device=DEV)
    )


def norm_weight(n: int) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n, device=DEV, dtype=torch.bfloat16)


@dataclass
class Layer:
    qkv_a: tuple
    q_b: tuple
    o_proj: tuple
    w_uk: torch.Tensor  # [H, NOPE, KVR] bf16: q_nope -> latent
    w_uv: torch.Tensor  # [H, KVR, VD] bf16: latent -> v
    norms: dict
    dense: tuple | None = None  # (gate_up, down) for the first layers
    moe: dict | None = None
    rowwise: dict = field(default_factory=dict)  # projection name -> (wq, ws [1, N]) when requantized


def build_layer(i: int, local_experts: int, fuse_shared: bool) -> Layer:
    norms = {k: norm_weight(n) for k, n in [("in", D), ("post", D), ("q", QR), ("kv", KVR)]}
    layer = Layer(
        qkv_a=fp8_weight(QR + KVR + ROPE, D), q_b=fp8_weight(HEADS * (NOPE + ROPE), QR),
        o_proj=fp8_weight(D, HEADS * VD),
        w_uk=torch.randn(HEADS, NOPE, KVR, device=DEV, dtype=torch.bfloat16) / math.sqrt(NOPE),
        w_uv=torch.randn(HEADS, KVR, VD, device=DEV, dtype=torch.bfloat16) / math.sqrt(KVR), norms=norms,
    )  # fmt: skip
    if i < DENSE_LAYERS:
        layer.dense = (fp8_weight(2 * INTER_DENSE, D), fp8_weight(D, INTER_DENSE))
    else:
        layer.moe = {
            "gate_t": torch.randn(D, EXPERTS, device=DEV, dtype=torch.bfloat16) / math.sqrt(D),  # [D, E]
            "bias": 0.01 * torch.randn(EXPERTS, device=DEV),
            # the shared expert: [local_experts] of w13/w2 when fused, this pair when not
            "shared": (fp8_weight(2 * INTER_MOE, D), fp8_weight(D, INTER_MOE)) if not fuse_shared else None,
            "w13": fp8_weight(2 * INTER_MOE, D, local_experts + fuse_shared),
            "w2": fp8_weight(D, INTER_MOE, local_experts + fuse_shared),
        }  # fmt: skip
    return layer


@dataclass
class Rank:
    layers: list
    embed: torch.Tensor
    head: torch.Tensor
    final_norm: torch.Tensor
    kv: torch.Tensor  # [LAYERS, slots, 576]
    cos_sin: torch.Tensor
    local_experts: int
    mla_cfg: MLAConfig
    fuse_shared: bool = True
    comm: object = None  # callable("dispatch" | "combine") or None
    fi: object = None  # libs.kernels.flashinfer_mla.FlashInferMLA when --attn flashinfer
    dense_fp8: str = "block"  # "rowwise": dense projections through torch._scaled_mm (Layer.rowwise)


@dataclass
class Batch:
    """Static buffers of one batch size: what CUDA graphs read and write."""

    b: int
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: int
    m_max: int
    scratch: dict = field(default_factory=dict)


def make_batch(rank: Rank, b: int, ctx: int, gen: int, max_ctx: int, gen_seed: int = 0) -> Batch:
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    pages_per_seq = math.ceil(max_ctx / PAGE)
    total_pages = rank.kv.shape[1] // PAGE
    table = (
        torch.randperm(total_pages, device=DEV, generator=g)[: b * pages_per_seq].view(b, pages_per_seq).int()
    )
    seq_lens = (ctx + torch.randint(0, gen + 1, (b,), device=DEV, generator=g)).int()
    pos = (seq_lens - 1).long()
    slots = table.gather(1, (pos // PAGE)[:, None]).squeeze(1).long() * PAGE + pos % PAGE
    ids = torch.randint(0, VOCAB, (b,), device=DEV, generator=g)
    splits = choose_num_splits(b, HEADS, ctx + gen // 2, rank.mla_cfg)
    bt = Batch(b, ids, pos, slots, table, seq_lens, splits, m_max=b * TOPK)
    bt.scratch["q_rope"] = torch.empty(b, HEADS, ROPE, device=DEV, dtype=torch.bfloat16)
    bt.scratch["o_lat"] = torch.zeros(b, HEADS, KVR, device=DEV, dtype=torch.bfloat16)
    bt.scratch["q_lat"] = torch.randn(HEADS, b, KVR, device=DEV, dtype=torch.bfloat16)
    e = rank.local_experts + (1 if rank.fuse_shared else 0)
    bt.scratch["temperature"] = torch.full((b,), 0.7, device=DEV)
    bt.scratch["seed"] = torch.arange(b, device=DEV)
    bt.scratch["bq"] = torch.zeros(e, bt.m_max, D, device=DEV, dtype=G.FP8)
    bt.scratch["bs"] = torch.ones(e, bt.m_max, D // 128, device=DEV)
    bt.scratch["next"] = torch.empty(b, device=DEV, dtype=torch.long)
    if rank.fi is not None:  # host-side planning, once per batch composition, outside the graph
        rank.fi.plan(table, bt.seq_lens, PAGE, HEADS, SM_SCALE)
    return bt


def linear(x, wt):
    xq, xs = quant.quant_fp8_groups(x)
    return G.fp8_gemm(xq, xs, wt[0], wt[1])


def block_weights(lw: Layer) -> dict:
    """The layer's dense block-scaled projections by name (what --dense-fp8 rowwise requantizes)."""
    named = {"qkv_a": lw.qkv_a, "q_b": lw.q_b, "o_proj": lw.o_proj}
    if lw.dense is not None:
        named.update(gate_up=lw.dense[0], down=lw.dense[1])
    if lw.moe is not None and lw.moe["shared"] is not None:
        named.update(shared_gate_up=lw.moe["shared"][0], shared_down=lw.moe["shared"][1])
    return named


def requant_rank(rank: Rank) -> None:
    for lw in rank.layers:
        lw.rowwise = {name: RW.requant_rowwise(*wt) for name, wt in block_weights(lw).items()}


def norm_for_proj(rank: Rank, x: torch.Tensor, w: torch.Tensor, residual=None):
    """RMSNorm whose output only feeds a block-scaled projection: straight to 1x128 FP8 in one kernel
    (add_rmsnorm_quant); bf16 in row-wise mode, which quantizes per token itself."""
    if rank.dense_fp8 == "block":
        return fused.add_rmsnorm_quant(x, w, EPS, residual=residual)
    return fused.add_rmsnorm(x, w, EPS, residual=residual)


def proj(rank: Rank, lw: Layer, name: str, x, swiglu: bool = False) -> torch.Tensor:
    """One dense FP8 projection in the rank's mode; swiglu: x is [gate | up], SiLU(gate) * up is the input;
    x may already be (fp8, scales) from norm_for_proj."""
    if isinstance(x, tuple):
        return G.fp8_gemm(*x, *block_weights(lw)[name])
    if rank.dense_fp8 == "rowwise":
        return RW.linear_rowwise(x, *lw.rowwise[name], swiglu=swiglu)
    wt = block_weights(lw)[name]
    if swiglu:
        return G.fp8_gemm(*quant.silu_mul_quant(x), *wt)
    return linear(x, wt)


def attention(rank: Rank, bt: Batch, i: int, lw: Layer, x: torch.Tensor, parts: set) -> torch.Tensor | None:
    sc = bt.scratch
    kv = rank.kv[i]
    if "other" in parts:
        qkv = proj(rank, lw, "qkv_a", x)  # [B, 2112]
        q_c = norm_for_proj(rank, qkv[:, :QR], lw.norms["q"])
        q = proj(rank, lw, "q_b", q_c).view(bt.b, HEADS, NOPE + ROPE)
        torch.bmm(q[..., :NOPE].transpose(0, 1), lw.w_uk, out=sc["q_lat"])  # [H, B, KVR]
        fused.rope_and_write_kv(  # kv latent norm fused into the cache write
            q[..., NOPE:], sc["q_rope"], qkv[:, QR + KVR :], qkv[:, QR : QR + KVR], kv, bt.positions, bt.slots,
            rank.cos_sin, kv_norm=lw.norms["kv"], eps=EPS,
        )  # fmt: skip
    if "attn" in parts and rank.fi is not None:
        rank.fi.run(sc["q_lat"].transpose(0, 1), sc["q_rope"], kv, out=sc["o_lat"])
    elif "attn" in parts:
        mla_decode(sc["q_lat"].transpose(0, 1), kv, bt.table, bt.seq_lens, PAGE, SM_SCALE, num_splits=bt.num_splits,
                   cfg=rank.mla_cfg, out=sc["o_lat"], q_rope=sc["q_rope"])  # fmt: skip
    if "other" in parts:
        o = torch.bmm(sc["o_lat"].transpose(0, 1), lw.w_uv).transpose(0, 1)  # [B, H, VD] view of [H, B, VD]
        if rank.dense_fp8 == "block":  # quantized and gathered into token rows in one pass, no copy
            return proj(rank, lw, "o_proj", quant.quant_fp8_heads(o))
        return proj(rank, lw, "o_proj", o.reshape(bt.b, HEADS * VD))
    return None


def moe(rank: Rank, bt: Batch, lw: Layer, x: torch.Tensor) -> torch.Tensor:
    sc, m = bt.scratch, lw.moe
    logits = torch.mm(x, m["gate_t"])  # bf16: the routing kernel reads it in fp32
    shared = None
    if rank.fuse_shared:  # the shared expert is one more local expert that every token visits, weight 1
        weights, local = routing.route(
            logits, m["bias"], TOPK, N_GROUP, TOPK_GROUP, SCALING, shared_expert=rank.local_experts
        )
        local[:, :TOPK] %= rank.local_experts  # stands in for the pairs other ranks send here
    else:
        weights, ids = routing.route(logits, m["bias"], TOPK, N_GROUP, TOPK_GROUP, SCALING)
        local = ids % rank.local_experts
        shared = proj(rank, lw, "shared_down", proj(rank, lw, "shared_gate_up", x), swiglu=True)
    dest, counts = moe_ops.align_masked(local.view(-1), sc["bq"].shape[0], bt.m_max)
    moe_ops.dispatch_quant(x, dest, sc["bq"], sc["bs"])  # quantize once, land in the masked layout
    if rank.comm is not None:
        rank.comm("dispatch")
    out = moe_ops.moe_masked(sc["bq"], sc["bs"], counts, *m["w13"], *m["w2"])
    if rank.comm is not None:
        rank.comm("combine")
    return moe_ops.combine_fused(out, dest, weights, add=shared)


def mlp(rank: Rank, bt: Batch, lw: Layer, x: torch.Tensor, parts: set) -> torch.Tensor | None:
    if lw.dense is not None:
        if "other" not in parts:
            return None
        return proj(rank, lw, "down", proj(rank, lw, "gate_up", x), swiglu=True)
    return moe(rank, bt, lw, x) if "moe" in parts else None


def decode_step(rank: Rank, bt: Batch, parts: set) -> torch.Tensor:
    h = rank.embed[bt.ids]
    residual = torch.zeros_like(h)
    for i, lw in enumerate(rank.layers):
        if "other" in parts:  # the attention input feeds only the fused q_a/kv_a projection
            x = norm_for_proj(rank, h, lw.norms["in"], residual=residual)
        else:  # part-only graphs pass the hidden state through in bf16
            x = fused.add_rmsnorm(h, lw.norms["in"], EPS, residual=residual)
        h = attention(rank, bt, i, lw, x, parts)
        h = h if h is not None else x
        x = fused.add_rmsnorm(h, lw.norms["post"], EPS, residual=residual)
        h = mlp(rank, bt, lw, x, parts)
        h = h if h is not None else x
    if "other" in parts:
        x = fused.add_rmsnorm(h, rank.final_norm, EPS, residual=residual)
        logits = F.linear(x, rank.head)  # [B, V] bf16
        sc = bt.scratch
        sampling.gumbel_sample(logits, sc["temperature"], sc["seed"], bt.positions, out=sc["next"])
    return bt.scratch["next"]


def capture(rank: Rank, bt: Batch, parts: set) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up: autotuning and compilation happen outside the graph
            decode_step(rank, bt, parts)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_step(rank, bt, parts)
    return g


def build_rank(max_b: int, max_ctx: int, local_experts: int, mla_cfg: MLAConfig, fuse_shared: bool = True) -> Rank:
    layers = [build_layer(i, local_experts, fuse_shared) for i in range(LAYERS)]
    slots = max_b * math.ceil(max_ctx / PAGE) * PAGE
    kv = torch.empty(LAYERS, slots, KVR + ROPE, device=DEV, dtype=torch.bfloat16)
    for i in range(LAYERS):
        kv[i].normal_()
    return Rank(
        layers=layers,
        embed=torch.randn(VOCAB, D, device=DEV, dtype=torch.bfloat16),
        head=torch.randn(VOCAB, D, device=DEV, dtype=torch.bfloat16) / math.sqrt(D),
        final_norm=norm_weight(D),
        kv=kv,
        cos_sin=fused.rope_cos_sin(max_ctx + 1, device=DEV),
        local_experts=local_experts,
        mla_cfg=mla_cfg,
        fuse_shared=fuse_shared,
    )


def load_mla_config() -> MLAConfig:
    for folder in (os.environ.get("OUT"), "bench/results"):
        path = Path(folder or ".") / "mla_best.json"
        if folder and path.exists():
            return MLAConfig(**json.loads(path.read_text())["128"])
    return MLAConfig()


def make_comm(b: int, world: int):
    """Per MoE layer, all_to_all of this rank's EP-72 dispatch (fp8 + scales) and combine (bf16) bytes;
    half of each buffer stays local, the other half crosses NVLink, sized so the crossing half is the
    rank's full per-layer traffic."""
    import torch.distributed as dist

    per_rank = {"dispatch": b * TOPK * (D + D // 128 * 4), "combine": b * TOPK * D * 2}
    bufs = {k: (torch.randint(0, 255, (world * n,), device=DEV, dtype=torch.uint8), torch.empty(world * n, device=DEV, dtype=torch.uint8))
            for k, n in per_rank.items()}  # fmt: skip

    def comm(kind: str) -> None:
        src, dst = bufs[kind]
        dist.all_to_all_single(dst, src)

    return comm, per_rank


def run_batch(rank: Rank, b: int, a, env: dict, world: int) -> list[dict]:
    from bench.decode_rank_checks import check_attention, profile_step

    bt = make_batch(rank, b, a.ctx, a.gen, a.ctx + a.gen)
    attn_err = check_attention(rank, bt)
    if a.profile == b:
        profile_step(
            rank,
            bt,
            Path(os.environ.get("OUT") or "bench/results") / f"profile-b{b}-{a.attn}-{rank.dense_fp8}.txt",
        )
    times = {}
    for name, parts in [("full", {"attn", "moe", "other"}), ("attention", {"attn"}), ("moe", {"moe"})]:
        g = capture(rank, bt, parts)
        times[name] = sorted(graph_ms(g, a.iters))[a.iters // 2]
        del g
    comm_ms = None
    comm_err = None
    if world > 1:
        rank.comm, per_rank = make_comm(b, world)
        try:
            g = capture(rank, bt, {"attn", "moe", "other"})
            comm_ms = sorted(graph_ms(g, a.iters))[a.iters // 2]
            del g
        except Exception as e:  # NCCL inside graph capture unavailable: say so rather than stop
            comm_err = f"{type(e).__name__}: {str(e)[:300]}"
            print("comm capture failed:", comm_err, flush=True)
        rank.comm = None
    torch.cuda.empty_cache()
    mean_ctx = float(bt.seq_lens.float().mean())
    roof = decode_step_bound(b, mean_ctx)
    step = times["full"]
    rec = {
        "benchmark": "decode_rank", "batch": b, "ctx": round(mean_ctx, 1), "prompt": a.ctx, "gen": a.gen,
        "step_ms": step, "itl_ms": step, "tokens_per_s_per_gpu": b / step * 1e3,
        "attention_ms": times["attention"], "moe_ms": times["moe"],
        "other_ms": step - times["attention"] - times["moe"],
        "roofline_step_ms": roof["step_s"] * 1e3, "roofline_fraction": roof["step_s"] * 1e3 / step,
        "roofline_tokens_per_s": roof["tokens_per_s"], "num_splits": bt.num_splits, "m_max": bt.m_max,
        "mla_config": asdict(rank.mla_cfg),
        "cuda_graph": True, "ep": 72, "local_experts": rank.local_experts, "attention_backend": a.attn,
        "attention_rel_err_vs_triton": attn_err, "shared_expert_fused": rank.fuse_shared,
        "dense_fp8": rank.dense_fp8, "moe_fp8": "block",
        "fp8_gemm_kernel": {str(k): str(v) for k, v in G._KERNEL_CHOICE.items() if k[1] in (b, bt.m_max)},
        "fp8_split_k": {str(k): v for k, v in G._SPLIT_CHOICE.items() if k[0] == b},
    }  # fmt: skip
    if comm_err is not None:
        rec["comm_error"] = comm_err
    if comm_ms is not None:
        rec.update({"step_ms_with_comm": comm_ms, "tokens_per_s_per_gpu_with_comm": b / comm_ms * 1e3,
                    "comm_bytes_per_layer": per_rank, "world": world})  # fmt: skip
    rec.update(env)
    return [rec]


def worker(local_rank: int, world: int, a) -> None:
    torch.cuda.set_device(local_rank)
    if world > 1 and "FLASHINFER_WORKSPACE_BASE" in os.environ:  # one JIT folder per process: no build race
        os.environ["FLASHINFER_WORKSPACE_BASE"] += f"/rank{local_rank}"
    if world > 1:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group(
            "nccl", rank=local_rank, world_size=world, device_id=torch.device("cuda", local_rank)
        )
    torch.manual_seed(local_rank)
    batches = [int(x) for x in a.batch.split(",")]
    env = environment()
    rank = build_rank(max(batches), a.ctx + a.gen, a.physical // a.ep, load_mla_config(), not a.separate_shared)
    if a.attn == "flashinfer":
        from libs.kernels.flashinfer_mla import FlashInferMLA

        rank.fi = FlashInferMLA("cuda")
    modes = a.dense_fp8.split(",")
    extra_rec = {}
    if "rowwise" in modes:
        t0 = time.perf_counter()
        requant_rank(rank)
        torch.cuda.synchronize()
        extra_rec["rowwise_requant_s"] = time.perf_counter() - t0
    from bench.decode_rank_checks import check_dense_fp8

    check = check_dense_fp8(rank, 256 if 256 in batches else batches[0])
    if local_rank == 0:
        for key, v in check.items():
            print(f"dense fp8 {key}: {v}", flush=True)
        write_results("dense_fp8_check", [{"benchmark": "dense_fp8_check", **check, **env}])
    name = f"decode_rank-w{world}-{a.attn}" + ("" if modes == ["block"] else "-" + "-".join(modes))
    records = []
    for b, mode in [(b, m) for b in batches for m in modes]:  # both modes of one batch back to back
        rank.dense_fp8 = mode
        records += run_batch(rank, b, a, env, world)
        r = records[-1]
        r.update(
            extra_rec,
            dense_fp8_o_proj_rel_err={
                act: check[f"o_proj/{act}"][mode]["rel_fro"] for act in ("gaussian", "outliers")
            },
        )
        if local_rank == 0 and os.environ.get("OUT"):  # kept if the command is stopped at its limit
            (Path(os.environ["OUT"]) / f"{name}-partial.json").write_text(json.dumps(records, indent=1))
        if local_rank == 0:
            extra = (
                f" | with NVLink comm {r['step_ms_with_comm']:.1f} ms -> {r['tokens_per_s_per_gpu_with_comm']:.0f} tok/s"
                if world > 1
                else ""
            )
            print(f"[{mode}] B={b} ctx={r['ctx']:.0f}: step {r['step_ms']:.2f} ms -> {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU "
                  f"(attn {r['attention_ms']:.2f}, moe {r['moe_ms']:.2f}, other {r['other_ms']:.2f}); "
                  f"roofline {r['roofline_step_ms']:.1f} ms = {r['roofline_fraction']:.2f}; attn err {r['attention_rel_err_vs_triton']:.1e}{extra}", flush=True)  # fmt: skip
    if local_rank == 0:
        print("wrote", write_results(name, records))
    if world > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,128,256,512")
    ap.add_argument("--ctx", type=int, default=2000)
    ap.add_argument("--gen", type=int, default=100)
    ap.add_argument("--ep", type=int, default=72)
    ap.add_argument("--physical", type=int, default=288)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--world", type=int, default=1, help="2: also move EP traffic over NVLink")
    ap.add_argument("--attn", choices=["triton", "flashinfer"], default="triton")
    ap.add_argument(
        "--separate-shared", action="store_true", help="shared expert as dense GEMMs, not a 5th local expert"
    )
    ap.add_argument("--profile", type=int, default=0, help="batch size to profile one eager step of")
    ap.add_argument(
        "--dense-fp8", default="block", help="block | rowwise | block,rowwise (see the module doc)"
    )
    a = ap.parse_args()
    if not a.dense_fp8 or set(a.dense_fp8.split(",")) - {"block", "rowwise"}:
        ap.error(f"--dense-fp8 takes block, rowwise or both comma-separated, got {a.dense_fp8!r}")
    if a.world > 1:
        torch.multiprocessing.spawn(worker, args=(a.world, a), nprocs=a.world)
    else:
        worker(0, 1, a)


if __name__ == "__main__":
    main()
