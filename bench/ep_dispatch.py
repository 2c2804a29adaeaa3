"""EP dispatch + combine time per MoE layer: libs.ep's all-to-all dispatcher (FP8 dispatch, BF16 combine),
DeepEP and Mooncake EP where they import, against raw NCCL `all_to_all_single` of the same bytes.

DeepSeek-V3 shapes by default: hidden 7168, top-8 of 256 routed experts, spread evenly over the ranks;
128 and 256 tokens per rank, routing uniform at random (seeded). Per case every rank times each iteration
with CUDA events after a barrier; the reported time is the median over iterations of the slowest rank.
The raw baseline sends, per destination, exactly the bytes the dispatcher sends (packed FP8 rows + scales
+ expert ids and weights) and then the combine's BF16 rows back, so the difference is the dispatcher's own
overhead (layout, header exchange, pack/unpack, the host sync for split sizes).

    python -m bench.ep_dispatch                      # spawns 2 processes, one per GPU
    torchrun --nproc-per-node 2 -m bench.ep_dispatch
    python -m bench.ep_dispatch --device cpu --hidden 1024 --iters 3   # gloo smoke run, no GPU

Results: bench/results/ep_dispatch-<time>.json (or under $OUT). The committed runs, their commands and
what they predate: docs/gpu.md ("Expert parallelism") and bench/NOTES-ep.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from libs.ep.comm import TorchComm
from libs.ep.dispatch.all_to_all import AllToAllDispatcher
from libs.ep.dispatch.factory import make_dispatcher
from libs.ep.placement import Placement
from libs.quant.fp8 import FP8_GROUP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 256], help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backends", default="torch,fixed,deepep,mooncake", help="comma list; missing ones are skipped")
    return p.parse_args(argv)


class Timer:
    """Per-iteration wall time on the device (CUDA events), or host time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1000.0
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6


def timed(fn: Callable[[], Any], timer: Timer, iters: int, warmup: int, device: torch.device) -> float:
    """Median over iterations of the slowest rank's microseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        us = timer(fn)
        worst = torch.tensor([us], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        times.append(float(worst))
    return statistics.median(times)


def routing(tokens: int, a: argparse.Namespace, rank: int, device: torch.device):
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.stack([torch.randperm(a.experts, generator=gen)[: a.topk] for _ in range(tokens)])
    x = torch.randn(tokens, a.hidden, generator=gen).to(torch.bfloat16)
    return x.to(device), ids.to(device), torch.rand(tokens, a.topk, generator=gen).to(device)


def raw_case(disp: AllToAllDispatcher, slots: torch.Tensor, a: argparse.Namespace, device: torch.device):
    """The dispatcher's exact per-destination byte counts, as two plain all_to_all_single calls."""
    n, s = dist.get_world_size(), disp.slots_per_rank
    dest = slots // s
    visits = torch.zeros(slots.shape[0], n, dtype=torch.bool, device=device).scatter_(1, dest, True)
    send_rows = visits.sum(0).tolist()
    rows = torch.tensor(send_rows, device=device)
    all_rows = [torch.empty_like(rows) for _ in range(n)]
    dist.all_gather(all_rows, rows)
    recv_rows = [int(r[dist.get_rank()]) for r in all_rows]
    dispatch_bytes = a.hidden + 4 * a.hidden // FP8_GROUP + 8 * a.topk  # fp8 row + scales + ids + weights
    combine_bytes = 2 * a.hidden  # bf16 row
    bufs = {}
    for name, width in (("dispatch", dispatch_bytes), ("combine", combine_bytes)):
        bufs[name] = (
            torch.empty(sum(send_rows), width, dtype=torch.uint8, device=device),
            torch.empty(sum(recv_rows), width, dtype=torch.uint8, device=device),
        )

    def run() -> None:
        send, recv = bufs["dispatch"]
        dist.all_to_all_single(recv, send, recv_rows, send_rows)
        send, recv = bufs["combine"]
        dist.all_to_all_single(send, recv, send_rows, recv_rows)

    sent = sum(send_rows) * dispatch_bytes + sum(recv_rows) * combine_bytes
    return run, sent


def ours_case(disp, x, slots, w) -> Callable[[], Any]:
    # the fixed dispatcher's header-free round (what a CUDA graph captures); the others' whole round
    exchange = getattr(disp, "exchange", None)

    def run() -> torch.Tensor:
        d = exchange(x, slots, w) if exchange is not None else disp.dispatch(x, slots, w)
        y = d.x  # no expert math: the bench times communication only
        return disp.combine(y, d)

    return run


def bench_rank(rank: int, world: int, a: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda", rank) if a.device == "cuda" else torch.device("cpu")
    placement = Placement.uniform(1, a.experts, world)
    comm = TorchComm(None, device)
    timer = Timer(device)
    records = []
    for tokens in a.tokens:
        x, ids, w = routing(tokens, a, rank, device)
        slots = placement.to_physical(0, ids, rank, placement.device_tables(device))
        ours = AllToAllDispatcher(comm, placement.slots_per_rank, fp8=True, combine_dtype=torch.bfloat16)
        raw, raw_bytes = raw_case(ours, slots, a, device)
        rec: dict[str, Any] = {
            "tokens_per_rank": tokens, "hidden": a.hidden, "topk": a.topk, "experts": a.experts, "world": world,
            "bytes_per_rank": raw_bytes, "raw_all_to_all_us": timed(raw, timer, a.iters, a.warmup, device),
        }  # fmt: skip
        for backend in a.backends.split(","):
            try:
                disp = ours if backend == "torch" else make_dispatcher(
                    backend, comm, slots_per_rank=placement.slots_per_rank, num_physical=placement.num_physical,
                    hidden=a.hidden, dtype=torch.bfloat16, fp8=True, group=dist.group.WORLD,
                    **({"top_k": a.topk, "max_tokens": tokens} if backend == "fixed" else {}),
                )  # fmt: skip
                rec[f"{backend}_us"] = timed(ours_case(disp, x, slots, w), timer, a.iters, a.warmup, device)
            except Exception as e:  # a backend that is not installed or fails here is reported, not fatal
                rec[f"{backend}_skipped"] = f"{type(e).__name__}: {e}"
        records.append(rec)
        if rank == 0:
            print(rec, flush=True)
    return records


def worker(rank: int, world: int, a: argparse.Namespace) -> None:
    if a.device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)  # ranks share the host's cores; spinning intra-op threads starve each other
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        records = bench_rank(rank, world, a)
        if rank == 0:
            from bench.harness import environment, write_results

            env = environment() if a.device == "cuda" else {"device": "cpu", "torch": torch.__version__}
            path = write_results("ep_dispatch", [{"env": env, "args": vars(a)}, *records])
            print(f"wrote {path}", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), int(os.environ["WORLD_SIZE"]), a)
        return
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        raise SystemExit(
            f"needs {a.world} GPUs, found {torch.cuda.device_count()} (use --device cpu for a smoke run)"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.multiprocessing.spawn(worker, args=(a.world, a), nprocs=a.world)


if __name__ == "__main__":
    main()
