"""`moemesh tune --model DIR`: the offline tune step of the FP8 GEMMs (libs/kernels/tune_step.py). Every GEMM
shape the worker settings given here meet is timed on this GPU and the fastest kernel written to a tuning
table in --table-dir (default: the user's MOEMESH_TUNING_DIR), which serving processes read at start."""

from __future__ import annotations

import argparse
import time
from typing import Any


def add_parser(subparsers: Any) -> None:
    from libs.engine.args import EngineArgs

    d = EngineArgs()
    p = subparsers.add_parser(
        "tune",
        help="time the FP8 GEMM kernels of a model on this GPU into a tuning table (ahead of serving)",
        description="Run a worker's warm-up stage by stage (every prefill length bucket up to "
        "--max-prefill-tokens, every decode graph batch up to --max-num-seqs) with kernel timing on, writing "
        "each shape's fastest kernel to <table-dir>/<device>_triton_<version>.json. Serving never times "
        "kernels: a shape without an entry takes a fixed default.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors)")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (default cuda)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32 (default auto)")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens, help="as the workers'")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="as the workers'")
    p.add_argument("--page-size", type=int, default=d.page_size, help="as the workers'")
    p.add_argument("--num-pages", type=int, default=d.num_pages, help="as the workers' (0: the default)")
    p.add_argument("--table-dir", default="", help="where the table is written (default: MOEMESH_TUNING_DIR)")
    p.add_argument("--retune", action="store_true", help="time shapes the tables already answer, too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from libs.engine import Engine
    from libs.kernels import gemm_tuning
    from libs.kernels.tune_step import tune_engine

    table_dir = args.table_dir or gemm_tuning.cache_dir()
    if table_dir is None:
        raise ValueError(f"{gemm_tuning.CACHE_ENV} is set empty; pass --table-dir")
    if not args.device.startswith("cuda"):
        raise ValueError(f"tuning times kernels on a GPU; --device {args.device} has none")
    started = time.monotonic()
    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, max_prefill_tokens=args.max_prefill_tokens,
        max_num_seqs=args.max_num_seqs, page_size=args.page_size, num_pages=args.num_pages,
    )  # fmt: skip
    print(f"model loaded in {time.monotonic() - started:.1f} s", flush=True)
    rec = tune_engine(
        engine, args.max_prefill_tokens, args.max_num_seqs, table_dir, retune=args.retune,
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    print(
        f"{rec['tuned']} shapes tuned ({rec['timings']} candidates, {rec['tuning_s']:.1f} s) in {rec['total_s']:.1f} s"
    )
    print(f"table: {rec['table']}")
    return 0
