"""Load time of DeepSeek-V3's released checkpoint per EP rank: measured on the reduced-width layout (the
release's 163 shards and 91,991 tensors, libs/engine/layout_model.py) through the loader EP ranks run
(libs.ep.loader.load_rank_model), then scaled to the 671B checkpoint's bytes.

    python -m bench.load_layout                       # writes the layout to a temp folder; EP 8, 16, 32
    python -m bench.load_layout --model DIR --ep 8 --ranks 3 --bandwidth-mb 4096 --dir /nvme/tmp

Scaling: a rank's load is its per-tensor and per-shard work (the same tensor count as the release's: the
layout keeps every name) plus its bytes over the storage's read rate. The first is measured on the layout
(which holds ~1/13,700 of the bytes); the second is the rank's full-size bytes (its share of the experts
plus every shared tensor, from the release's shapes) over the cold read rate measured here through the
same safetensors calls on full-size expert tensors (`--bandwidth-mb` of them, evicted from the page cache
with posix_fadvise first). `box_s` is a box of min(N, 8) ranks loading at once from one disk: the shared
part read once (the page cache serves the rest), the experts once each. Left out: CUDA start-up, the
copy to the GPU, building the model at full size, and anything the storage does above the measured rate.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from bench.harness import cpu_environment, write_results
from libs.engine.config import ModelConfig
from libs.engine.layout_model import is_fp8, tensor_bytes, write_layout_model, write_shard
from libs.engine.loader import ReadStats
from libs.engine.models.deepseek_v3 import CHECKPOINT_EXPERT_NAME
from libs.engine.presets import deepseek_v3_config
from libs.engine.tiny import weight_shapes
from libs.ep.loader import load_rank_model
from libs.ep.placement import Placement

BOX = 8  # GPUs of one box


def full_size_bytes(ep: int) -> dict[str, int]:
    """The 671B checkpoint's bytes a rank of `ep` reads (scales included, the MTP layer not): shared, its
    experts, and the whole checkpoint's."""
    cfg = deepseek_v3_config()
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    shared = experts = total = 0
    for name, shape in weight_shapes(cfg).items():
        n = tensor_bytes(name, shape)
        total += n
        if name.startswith(mtp):
            continue
        if CHECKPOINT_EXPERT_NAME.match(name):
            experts += n
        else:
            shared += n
    return {"shared": shared, "experts": experts // ep, "all_experts": experts, "checkpoint": total}


def scaled(measured_s: float, layout_bytes: int, full: dict[str, int], bandwidth: float, ep: int) -> dict:
    """Seconds for one rank alone on its disk and for a box of min(ep, 8) ranks sharing one."""
    rank_bytes = full["shared"] + full["experts"]
    per_rank = measured_s + (rank_bytes - layout_bytes) / bandwidth
    box_bytes = full["shared"] + min(ep, BOX) * full["experts"]
    return {
        "rank_bytes": rank_bytes, "rank_s": round(per_rank, 1),
        "box_bytes": box_bytes, "box_s": round(max(measured_s, box_bytes / bandwidth), 1),
    }  # fmt: skip


def read_rate(folder: Path, megabytes: int) -> dict:
    """Cold and warm GB/s of safe_open + get_tensor over full-size FP8 expert tensors ([2048, 7168] with their
    block scales), the page cache emptied for the file first."""
    shape = (2048, 7168)
    count = max(1, megabytes * 2**20 // math.prod(shape))
    name = "model.layers.3.mlp.experts.{}.up_proj.weight"
    assert is_fp8(name.format(0))
    tensors: dict[str, torch.Tensor] = {}
    for e in range(count):
        tensors[name.format(e)] = torch.randint(0, 120, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
        tensors[name.format(e) + "_scale_inv"] = torch.rand(16, 56)
    file = folder / "read-rate.safetensors"
    size = write_shard(folder, file.name, tensors, {})
    del tensors
    out: dict[str, float] = {"bytes": size}
    try:
        for kind in ("cold", "warm"):
            if kind == "cold":
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            with safe_open(str(file), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    f.get_tensor(key)
            out[f"{kind}_gb_s"] = round(size / (time.perf_counter() - start) / 1e9, 3)
    finally:
        file.unlink()
    return out


def time_ranks(model: Path, ep: int, ranks: int, device: str = "cpu") -> dict:
    """Seconds of load_rank_model for `ranks` ranks spread over the group (first, middle, last, ...)."""
    cfg = ModelConfig.from_pretrained(model)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    placement = Placement.uniform(moe, cfg.n_routed_experts, ep)
    chosen = sorted({round(i * (ep - 1) / max(1, ranks - 1)) for i in range(ranks)})
    rows = []
    for r in chosen:
        stats, start = ReadStats(), time.perf_counter()
        load_rank_model(model, placement, r, device=device, stats=stats)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        rows.append({"rank": r, "s": round(time.perf_counter() - start, 3), "bytes": stats.bytes,
                     "tensors": stats.tensors, "shards": len(stats.shards)})  # fmt: skip
    return {"ranks": rows, "median_s": statistics.median(r["s"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a v3-layout folder (default: write one to a temp folder)")
    p.add_argument("--ep", default="8,16,32", help="EP sizes, comma-separated")
    p.add_argument("--ranks", type=int, default=3, help="ranks timed per EP size (first, last, between)")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="full-size tensors read for the read rate")
    p.add_argument("--dir", default="", help="where the temp layout and read-rate file go (the disk measured)")
    p.add_argument("--device", default="cpu", help="where the ranks' weights go (cuda: FP8 kept, as a GPU rank)")
    p.add_argument("--name", default="load_layout", help="record name under bench/results")
    args = p.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        model, write_s = Path(args.model), 0.0
        if not args.model:
            start = time.perf_counter()
            model = write_layout_model(Path(tmp) / "v3-layout")
            write_s = time.perf_counter() - start
        rate = read_rate(Path(tmp), args.bandwidth_mb)
        rows = []
        for ep in (int(x) for x in args.ep.split(",")):
            measured = time_ranks(model, ep, args.ranks, args.device)
            full = full_size_bytes(ep)
            layout_bytes = statistics.median(r["bytes"] for r in measured["ranks"])
            rows.append({"ep": ep, **measured, "full_size": full,
                         **scaled(measured["median_s"], layout_bytes, full, rate["cold_gb_s"] * 1e9, ep)})  # fmt: skip
            print(f"EP {ep}: layout rank load {measured['median_s']:.2f} s; 671B rank "
                  f"{rows[-1]['rank_bytes'] / 1e9:.1f} GB -> {rows[-1]['rank_s']} s alone, box of "
                  f"{min(ep, BOX)} {rows[-1]['box_s']} s at {rate['cold_gb_s']} GB/s cold")  # fmt: skip
    record = {
        "bench": "load_layout", "command": "python -m bench.load_layout " + " ".join(sys.argv[1:]),
        "environment": cpu_environment(load), "disk": args.dir or tempfile.gettempdir(), "device": args.device,
        "layout_write_s": round(write_s, 2), "read_rate": rate, "rows": rows,
        "scaling": "rank_s = measured layout load + (671B rank bytes - layout rank bytes) / cold read rate; "
        "box_s = max(measured, (shared + min(ep, 8) x rank experts) / cold read rate)",
        "left_out": "CUDA start-up, host-to-GPU copies, full-size model allocation, storage above the measured rate",
    }  # fmt: skip
    print(write_results(args.name, [record]))


if __name__ == "__main__":
    main()
