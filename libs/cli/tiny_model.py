"""`moemesh tiny-model --out DIR [--seed N] [--fp8] [--force]`: write a random tiny DeepSeek-V3 checkpoint;
`--preset v3-width --layers 4 --experts 16 --top-k 8`: one of DeepSeek-V3's width (FP8, for GPUs);
`--preset v3-layout [--layers 61]`: DeepSeek-V3's released layout (names, dtypes, 163 shards) at a small width."""

from __future__ import annotations

import argparse
import time
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tiny-model",
        help="write a random tiny DeepSeek-V3-architecture checkpoint folder (made locally)",
        description="Write config.json, safetensors shards with an index, generation_config.json "
        "and a small BPE tokenizer with a DeepSeek-V3-style chat template. Nothing is downloaded. "
        "--preset v3-width writes DeepSeek-V3's width (hidden 7168, 128 heads, MLA dims, vocab 129,280, "
        "FP8 with 128x128 block scales) with fewer layers and experts, drawn on the GPU when there is one. "
        "--preset v3-layout writes the released checkpoint's layout (every tensor name and dtype, 61 layers + the "
        "MTP layer, 256 experts, index over 163 shards) at a small width: tens of MB.",
    )
    p.add_argument("--out", required=True, help="folder to write (created; must be empty unless --force)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument(
        "--fp8", action="store_true", help="store linear weights as FP8 e4m3 with 128x128 block scales"
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing the files")
    p.add_argument(
        "--preset", default="", choices=["", "v3-width", "v3-layout"],
        help="v3-width: a wide FP8 model instead of tiny; v3-layout: the released layout at a small width",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="--preset: decoder layers (default 4; v3-layout 61)")
    p.add_argument("--dense-layers", type=int, default=1, help="--preset: leading dense layers (default 1)")
    p.add_argument("--experts", type=int, default=16, help="--preset: routed experts (default 16)")
    p.add_argument("--top-k", type=int, default=8, help="--preset: experts per token (default 8)")
    p.add_argument("--device", default="", help="--preset: where tensors are drawn (default: cuda if any)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.preset == "v3-layout":
        from libs.engine.layout_model import write_layout_model

        path = write_layout_model(args.out, layers=args.layers or 61, seed=args.seed, overwrite=args.force)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"wrote DeepSeek-V3's layout ({args.layers or 61} layers + MTP, 256 experts, "
              f"{len(list(path.glob('*.safetensors')))} shards, {size / 1e6:.0f} MB) to {path} "
              f"in {time.monotonic() - started:.1f} s")  # fmt: skip
        return 0
    if args.preset:
        from libs.engine.preset_model import write_preset_model

        path = write_preset_model(
            args.out, args.preset, layers=args.layers or 4, experts=args.experts, top_k=args.top_k,
            dense_layers=args.dense_layers, seed=args.seed, device=args.device or None, overwrite=args.force,
        )  # fmt: skip
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(
            f"wrote {args.preset} checkpoint ({args.layers or 4} layers, {args.experts} experts, top-{args.top_k}, "
            f"{size / 1e9:.2f} GB, seed {args.seed}) to {path} in {time.monotonic() - started:.1f} s"
        )
        return 0
    from libs.engine.tiny import write_tiny_model

    path = write_tiny_model(args.out, seed=args.seed, fp8=args.fp8, overwrite=args.force)
    print(
        f"wrote tiny DeepSeek-V3 checkpoint ({'fp8' if args.fp8 else 'float32'}, seed {args.seed}) to {path}"
    )
    return 0
