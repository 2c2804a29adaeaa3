"""The fixed-capacity dispatcher on a GPU at world 1 (NCCL): one MoE round (FP8 dispatch -> grouped FP8
experts -> combine) captured in a CUDA graph replays what the same round computes eagerly, and both equal the
plain FP8 MoE on the rows as they crossed the wire. Skipped without CUDA (CI has none)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

T, K, S, D, I = 24, 4, 4, 256, 256


@pytest.fixture(scope="module")
def nccl_world1(tmp_path_factory: pytest.TempPathFactory):
    import torch.distributed as dist

    store = Path(tmp_path_factory.mktemp("nccl")) / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    yield
    dist.destroy_process_group()


def experts(g: torch.Generator) -> SimpleNamespace:
    def fp8(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.5).to(torch.float8_e4m3fn).cuda()

    def scales(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=g) * 0.02 + 0.01).cuda()

    return SimpleNamespace(
        gate_up_proj=fp8(S, 2 * I, D), gate_up_proj_scale_inv=scales(S, 2 * I // 128, D // 128),
        down_proj=fp8(S, D, I), down_proj_scale_inv=scales(S, D // 128, I // 128),
    )  # fmt: skip


def inputs(g: torch.Generator, t: int = T):
    x = torch.randn(t, D, generator=g).to(torch.bfloat16).cuda()
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(t)]).cuda()
    return x, slots, torch.rand(t, K, generator=g).cuda(), torch.randn(t, D, generator=g).to(torch.bfloat16).cuda()


def test_a_fixed_round_captured_in_a_cuda_graph_replays_the_eager_round(nccl_world1) -> None:
    from libs.ep.comm import TorchComm
    from libs.ep.dispatch.base import quantize_for_dispatch
    from libs.ep.dispatch.fixed import FixedDispatcher
    from libs.ep.experts import run_fp8_experts
    from libs.kernels.backend import fp8_moe_reference
    from libs.quant.fp8 import dequantize_fp8_groups

    g = torch.Generator().manual_seed(0)
    ex = experts(g)
    disp = FixedDispatcher(TorchComm(None, "cuda"), S, hidden=D, top_k=K, dtype=torch.bfloat16, max_tokens=T,
                           fp8=True)  # fmt: skip

    def round_(x, slots, w, add):
        d = disp.exchange(x, slots, w)
        return disp.combine(run_fp8_experts(ex, d), d, add=add)

    static = inputs(g)
    for _ in range(2):  # warm-up: kernel choices and the NCCL communicator before capture
        round_(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = round_(*static)
    for seed in (1, 2):
        new = inputs(torch.Generator().manual_seed(seed))
        eager = round_(*new)
        for dst, src in zip(static, new, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        x, slots, w, add = new
        xq = dequantize_fp8_groups(*quantize_for_dispatch(x), torch.bfloat16)
        w13 = (ex.gate_up_proj, ex.gate_up_proj_scale_inv)
        want = fp8_moe_reference(xq, slots, w, w13, (ex.down_proj, ex.down_proj_scale_inv), add)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    disp.check()  # capacity = max_tokens: no round can overflow


def test_more_tokens_than_the_buffers_is_refused_before_any_collective(nccl_world1) -> None:
    from libs.ep.comm import TorchComm
    from libs.ep.dispatch.fixed import FixedDispatcher

    disp = FixedDispatcher(TorchComm(None, "cuda"), S, hidden=D, top_k=K, dtype=torch.bfloat16, max_tokens=T)
    x, slots, w, _ = inputs(torch.Generator().manual_seed(3), T + 1)
    with pytest.raises(ValueError, match=f"{T + 1} tokens exceed"):
        disp.exchange(x, slots, w)


def test_decode_rank_real_dispatch_engine_graphs_equal_eager_steps(nccl_world1) -> None:
    """bench/decode_rank's rank Engine with --dispatch real (stepped hooks over the fixed dispatcher at world 1)
    captures its decode steps, and they pick the tokens the same model picks eagerly (greedy; a full bucket of
    8, so every GEMM sees the same shapes; prompt KV zero in both pools, whichever pages they got)."""
    import random

    import bench.decode_rank as R
    from libs.engine.engine import Engine
    from libs.engine.presets import deepseek_v3_config
    from libs.engine.sampling import SamplingParams

    config = deepseek_v3_config(
        hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256,
        n_routed_experts=64, n_group=8, topk_group=4, num_experts_per_tok=8, vocab_size=2048,
        max_position_embeddings=512,
    )  # fmt: skip
    graphs = R.build_engine(config, ep=8, physical=64, max_batch=8, max_ctx=128, attention="triton", page_size=16,
                            dispatch="real")  # fmt: skip
    assert graphs.runner.graphs is not None, "the stepped EP hooks must leave decode capturable"
    graphs.kv_pool.buffer.zero_()
    eager = Engine(
        graphs.model, page_size=16, num_pages=graphs.kv_pool.num_pages, max_num_seqs=8, enable_prefix_cache=False,
        attention_backend="triton", cuda_graphs=False, fast_path=True,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got: dict[str, dict[str, list[int]]] = {"graphs": {}, "eager": {}}
    for name, engine, steps in (("graphs", graphs, 6), ("eager", eager, 4)):  # overlap reports a step late
        rng = random.Random(1)
        for i in range(8):
            n = 40 + rng.randint(0, 8)
            engine.reserve(f"r{i}", n)
            engine.add_prefilled(f"r{i}", [rng.randrange(2048) for _ in range(n)], rng.randrange(2048), greedy)
        for _ in range(steps):
            for o in engine.step():
                got[name].setdefault(o.rid, []).extend(o.token_ids)
    assert len(got["eager"]) == 8 and all(len(v) == 4 for v in got["eager"].values())
    assert {rid: toks[:4] for rid, toks in got["graphs"].items()} == got["eager"]
