"""One EP rank of a DeepSeek-V3 671B decode deployment on one GPU, through the Engine the decode worker runs:
`Engine.step()` timed exactly as the worker calls it.

    python -m bench.decode_rank --batch 64,128,256,512 [--ctx 2000 --gen 100] [--attn auto|triton|flashinfer]
        [--ep 72 --physical 288] [--layers 61] [--profile 256] [--dispatch emulated|real] [--tbo]

The Engine is built from DeepSeek-V3's config (libs.engine.presets) with random FP8 block-scaled weights
(libs.engine.random_weights) and only this rank's local experts: EP-72 over 288 physical experts holds 4
per MoE layer. Each token's 8 routed picks are mapped onto those 4 (libs.ep.emulated): the expert GEMMs
see the 8 x B token-expert pairs a balanced EP-72 rank receives, but no dispatch or combine bytes move.
So every number here is one rank with EP communication emulated, not moved: it leaves out the
all-to-all traffic (and its overlap) and routing imbalance. `--dispatch real` keeps the same expert shapes
but sends the picks through the EP dispatcher's real code path at world 1 (libs.ep.stepped over
libs.ep.dispatch.fixed: FP8 rows packed into the fixed [max_batch, B] buffer, counts and rows through NCCL
all_to_all_single with one rank, the grouped GEMMs on the received rows, the combine back), captured in the
decode graphs like the rest of the step; the one thing it still cannot show is bytes crossing NVLink.

B requests join the engine as a decode worker's do (reserve + add_prefilled: their prompts' KV is in the
pool, as if a prefill worker had written it), with contexts of ctx + U(0..gen) tokens, temperature 0.7,
seeded. Then `Engine.step()` runs: scheduling, per-step metadata (FlashInfer's plan, sequence lengths),
host-to-device copies, the captured decode graph, sampling (one-pass Gumbel-max), the tokens copied back.
`step_ms` is that wall time per step; `graph_ms` is the captured graph replayed alone (CUDA events), so
`host_ms` = step - graph is what the host adds.

`--tbo` runs every step as two overlapped micro-batches (libs.engine.two_batch_overlap; `tbo` in the
record). With EP emulated there is no dispatch or combine to overlap: it measures what splitting the batch
costs (half-size GEMMs and attention), not what overlap gains on a real EP group. It needs `--attn triton`
or `--attn flashinfer` (one FlashInfer wrapper per micro-batch; `auto` takes FlashInfer where it imports).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from pathlib import Path

import torch

from bench.harness import environment, graph_ms, write_results
from bench.roofline import decode_step_bound
from libs.engine.args import KV_CACHE_DTYPES
from libs.engine.config import ModelConfig
from libs.engine.engine import Engine
from libs.engine.layers.fp8_linear import apply_fp8_weights
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.engine.presets import deepseek_v3_config
from libs.engine.random_weights import fill_random_
from libs.engine.sampling import SamplingParams
from libs.engine.tbo_split import decode_round_tokens
from libs.engine.tiny import is_fp8_weight
from libs.ep.emulated import EmulatedEP, enable_emulated_ep
from libs.kernels import mla_decode_fp8 as fp8_attn

PAGE = 64
COMMUNICATION = {
    "emulated": "emulated (no bytes moved)",
    "real": "fixed-capacity dispatcher at world 1 (FP8 rows through NCCL all_to_all_single to itself)",
}


class _DeepSeekFP8:
    """The weight names DeepSeek's FP8 checkpoint stores in FP8 (projections; not the head or the router)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and is_fp8_weight(name)


def build_engine(
    config: dict, *, ep: int, physical: int, max_batch: int, max_ctx: int, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16, attention: str = "auto", page_size: int = PAGE, seed: int = 0,
    dispatch: str = "emulated",
    two_batch_overlap: bool = False, kv_cache_dtype: str = "auto",
) -> Engine:  # fmt: skip
    """The Engine of one EP rank (physical // ep local experts per MoE layer, emulated EP), random FP8
    weights, a KV pool for max_batch sequences of max_ctx tokens. dispatch="real": the picks go through the
    fixed-capacity dispatcher at world 1 (`real_dispatch`) instead of the fused MoE's local mapping."""
    if dispatch not in ("emulated", "real"):
        raise ValueError(f"dispatch must be 'emulated' or 'real', got {dispatch!r}")
    cfg = ModelConfig.from_dict(config)
    local = physical // ep if ep > 1 else None
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg, dtype, device, local_experts=local)
    apply_fp8_weights(model, _DeepSeekFP8(), (128, 128))
    fill_random_(model, seed)
    if dispatch == "real":  # hooks set before the Engine is built, so its decode graphs capture them
        real_dispatch(model, local or cfg.n_routed_experts, decode_round_tokens(max_batch, two_batch_overlap))
        local = None
    pages = max_batch * math.ceil(max_ctx / page_size)
    engine = Engine(
        model, page_size=page_size, num_pages=pages, max_num_seqs=max_batch, enable_prefix_cache=False,
        attention_backend=attention, cuda_graphs=True, fast_path=True, two_batch_overlap=two_batch_overlap,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    if local is not None and enable_emulated_ep(model, local) == 0:
        raise RuntimeError("the model did not take the fused MoE path: EP cannot be emulated")
    engine.kv_pool.fill_normal_()  # as if prompts had been prefilled: attention reads real-looking rows
    return engine


def kv_roofline(engine: Engine) -> dict:
    """decode_step_bound's KV arguments for the engine's pool: bytes per cached value, and whether attention's
    dots run in FP8 (fp8_kernel's SM90 kernel or the Triton one in an FP8 dots mode; FlashInfer over "tensor"
    rows and the Triton kernel's bf16 dots dequantize first)."""
    pool = engine.kv_pool
    fp8_dots = fp8_kernel(engine) not in (None, "triton-bf16-dots")
    return {"kv_bytes": pool.row_width * pool.buffer.element_size() / pool.row_dim, "mla_fp8": fp8_dots}


def fp8_kernel(engine: Engine) -> str | None:
    """Which kernel decodes the pool's "token" FP8 rows (attention_backend's choice): the Gluon SM90 kernel (FP8
    dots; its seesaw schedule with MOEMESH_MLA_FP8=seesaw) where it reads the pages and heads, else the Triton one
    with its dots mode; None without them."""
    from libs.kernels import mla_decode_fp8_sm90 as sm90
    from libs.kernels import mla_decode_fp8_sm90_seesaw as seesaw

    pool = engine.kv_pool
    if pool.fp8 is None or pool.fp8.scales != "token":
        return None
    heads = engine.model.config.num_attention_heads
    if sm90.available(pool.buffer.device, pool.page_size, heads):
        return "gluon-sm90-seesaw-fp8-dots" if seesaw.chosen() else "gluon-sm90-fp8-dots"
    return f"triton-{fp8_attn.DECODE_DOTS}-dots"


def real_dispatch(model: DeepseekV3ForCausalLM, local: int, max_tokens: int) -> None:
    """Every MoE layer of `model` (its `local` experts FP8) through the fixed-capacity dispatcher of a one-rank
    group (NCCL on CUDA, gloo on CPU; started here if the process has none): each token's K routed picks
    mapped onto the local experts as in the emulated rank (so one token may pick an expert twice: the masked
    buffers get K rows per token), FP8 dispatch, bf16 combine."""
    import tempfile

    import torch.distributed as dist

    from libs.ep.comm import TorchComm
    from libs.ep.dispatch.fixed import FixedDispatcher
    from libs.ep.placement import Placement
    from libs.ep.runtime import moe_layers
    from libs.ep.stepped import enable_stepped_ep

    cfg = model.config
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="decode-rank-")) / "store"
        dist.init_process_group("nccl" if model.device.type == "cuda" else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1, device_id=indexed_device(model.device))  # fmt: skip
    dispatcher = FixedDispatcher(
        TorchComm(None, model.device), local, hidden=cfg.hidden_size, top_k=cfg.num_experts_per_tok,
        dtype=model.dtype, max_tokens=max_tokens, fp8=True,
    )  # fmt: skip
    placement = Placement.uniform(len(moe_layers(model)), local, 1)
    enable_stepped_ep(model, placement, 0, dispatcher, remap=EmulatedEP(local),
                      rows_per_expert_factor=cfg.num_experts_per_tok)  # fmt: skip


def indexed_device(device: torch.device) -> torch.device | None:
    """The `device_id` init_process_group takes: None off CUDA; on CUDA the device with its index (torch 2.11
    refuses a bare "cuda": "Please use a device_id with index"), the current one when `device` names none."""
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def fill(engine: Engine, b: int, ctx: int, gen: int, seed: int = 0) -> list[str]:
    """B decoding requests, each joined as a decode worker joins a prefilled one."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    rids = []
    for i in range(b):
        n = ctx + rng.randint(0, gen)
        rid = f"b{b}-{i}"
        engine.reserve(rid, n)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        room = engine.config.max_position_embeddings - n
        params = SamplingParams(temperature=0.7, max_tokens=room, ignore_eos=True, seed=seed * 100_003 + i)
        engine.add_prefilled(rid, prompt, rng.randrange(vocab), params)
        rids.append(rid)
    return rids


def time_steps(engine: Engine, b: int, warmup: int, iters: int) -> dict:
    for _ in range(warmup):  # the first step of a batch size captures its graph; overlapped decode
        engine.step()  # reports each step's tokens one call later, so the first call reports none
    torch.cuda.synchronize()
    steps = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = engine.step()
        steps.append((time.perf_counter() - t0) * 1e3)
        assert len(out) == b
    graphs = engine.runner.graphs
    replay = None
    if graphs is not None and graphs.captured:
        bucket = min(s for s in graphs.captured if s >= b)
        g = graphs._graphs[bucket].graph
        assert g is not None
        replay = sorted(graph_ms(g, iters))[iters // 2]
    return {"step_ms": sorted(steps)[iters // 2], "graph_ms": replay, "step_ms_all": [round(s, 3) for s in steps]}


def profile(engine: Engine, path: Path, steps: int = 3) -> None:
    """`steps` engine steps under torch.profiler: operators and kernels by CUDA time, written to path."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    path.write_text(p.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70))


def run(a) -> list[dict]:
    batches = [int(x) for x in a.batch.split(",")]
    config = deepseek_v3_config(num_hidden_layers=a.layers, max_position_embeddings=a.ctx + a.gen + 512)
    t0 = time.perf_counter()
    engine = build_engine(
        config, ep=a.ep, physical=a.physical, max_batch=max(batches), max_ctx=a.ctx + a.gen + 64,
        attention=a.attn, dispatch=a.dispatch, two_batch_overlap=a.tbo, kv_cache_dtype=a.kv_cache_dtype,
    )  # fmt: skip
    build_s = time.perf_counter() - t0
    env = environment()
    backend = engine.runner.backend.name
    out_dir = Path(os.environ.get("OUT") or "bench/results")
    records = []
    for b in batches:
        rids = fill(engine, b, a.ctx, a.gen, seed=b)
        ctx = sum(engine.requests[r].num_tokens for r in rids) / b
        t = time_steps(engine, b, a.warmup, a.iters)
        if a.profile == b:
            profile(engine, out_dir / f"profile-engine-b{b}-{backend}.txt")
        for r in rids:
            engine.abort(r)
        kv = kv_roofline(engine)
        roof = decode_step_bound(b, ctx, ep=a.ep, physical=a.physical, layers=a.layers, **kv)
        spec = decode_step_bound(b, ctx, ep=a.ep, physical=a.physical, layers=a.layers, peaks="spec", **kv)
        step = t["step_ms"]
        rec = {
            "benchmark": "decode_rank", "path": "engine", "batch": b, "ctx": round(ctx, 1), "prompt": a.ctx,
            "gen": a.gen, "layers": a.layers, "tokens_per_s_per_gpu": b / step * 1e3, **t,
            "host_ms": step - t["graph_ms"] if t["graph_ms"] is not None else None,
            "roofline_step_ms": roof["step_s"] * 1e3, "roofline_fraction": roof["step_s"] * 1e3 / step,
            "roofline_spec_step_ms": spec["step_s"] * 1e3, "roofline_fraction_spec": spec["step_s"] * 1e3 / step,
            "attention_backend": backend, "kv_cache_dtype": a.kv_cache_dtype, "fp8_kernel": fp8_kernel(engine),
            "kv_format": engine.kv_pool.format_name, "ep": a.ep, "physical_experts": a.physical,
            "local_experts": a.physical // a.ep, "dispatch": a.dispatch, "ep_communication": COMMUNICATION[a.dispatch],
            "fast_path": engine.model.fast is not None, "cuda_graph": engine.runner.graphs is not None,
            "tbo": engine.model.tbo is not None,
            "build_s": round(build_s, 1), **env,
        }  # fmt: skip
        records.append(rec)
        print(
            f"B={b} ctx={ctx:.0f}: step {step:.2f} ms (graph {t['graph_ms']:.2f}, host {rec['host_ms']:.2f}) -> "
            f"{rec['tokens_per_s_per_gpu']:.0f} tok/s/GPU; roofline {rec['roofline_fraction']:.2f} measured peaks, "
            f"{rec['roofline_fraction_spec']:.2f} spec [{backend}, KV {a.kv_cache_dtype}"
            f"{' ' + rec['fp8_kernel'] if rec['fp8_kernel'] else ''}, EP {a.dispatch}"
            f"{', TBO' if a.tbo else ''}]", flush=True,
        )  # fmt: skip
    suffix = ("-real-dispatch" if a.dispatch == "real" else "") + ("-tbo" if a.tbo else "")
    suffix += f"-{engine.kv_pool.format_name}" if a.kv_cache_dtype != "auto" else ""
    print("wrote", write_results(f"decode_rank-engine-{backend}{suffix}", records))
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,128,256,512")
    ap.add_argument("--ctx", type=int, default=2000)
    ap.add_argument("--gen", type=int, default=100)
    ap.add_argument("--ep", type=int, default=72)
    ap.add_argument("--physical", type=int, default=288)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--attn", choices=["auto", "triton", "flashinfer"], default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", type=int, default=0, help="batch size to profile three steps of")
    ap.add_argument("--dispatch", choices=["emulated", "real"], default="emulated",
                    help="emulated: picks mapped onto local experts in the fused MoE; real: through the EP "
                    "dispatcher at world 1")  # fmt: skip
    ap.add_argument("--tbo", action="store_true", help="two-batch overlap (needs --attn triton or flashinfer)")
    ap.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                    help="the latent KV cache: auto (bf16) or fp8_e4m3 (FP8 rows, the FP8 MLA decode kernel)")  # fmt: skip
    ap.add_argument("--fp8-dots", choices=list(fp8_attn.DOTS), default=fp8_attn.DECODE_DOTS,
                    help="with fp8_e4m3: which of QK / PV the decode kernel runs on FP8 tensor cores")  # fmt: skip
    a = ap.parse_args()
    fp8_attn.DECODE_DOTS = a.fp8_dots
    run(a)


if __name__ == "__main__":
    main()
