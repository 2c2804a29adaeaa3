"""`moemesh tiny-model --out DIR [--seed N] [--fp8] [--force]`: write a random tiny DeepSeek-V3 checkpoint."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tiny-model",
        help="write a random tiny DeepSeek-V3-architecture checkpoint folder (made locally)",
        description="Write config.json, two safetensors shards with an index, generation_config.json "
        "and a small BPE tokenizer with a DeepSeek-V3-style chat template. Nothing is downloaded.",
    )
    p.add_argument("--out", required=True, help="folder to write (created; must be empty unless --force)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument(
        "--fp8", action="store_true", help="store linear weights as FP8 e4m3 with 128x128 block scales"
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing the files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from libs.engine.tiny import write_tiny_model

    path = write_tiny_model(args.out, seed=args.seed, fp8=args.fp8, overwrite=args.force)
    print(
        f"wrote tiny DeepSeek-V3 checkpoint ({'fp8' if args.fp8 else 'float32'}, seed {args.seed}) to {path}"
    )
    return 0
