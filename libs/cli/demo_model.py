"""`moemesh demo-model [--out DIR] [--steps N]`: train the demo model (pydoc corpus, CPU, minutes)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo-model",
        help="train the small DeepSeek-V3 demo model (with MTP) on CPython's pydoc text; cached",
        description="Trains the byte-level BPE tokenizer and a small DeepSeek-V3-architecture model (MLA, "
        "routed + shared experts, noaux_tc gate, one MTP module) on the pydoc topics CPython ships, then "
        "writes a Hugging Face checkpoint folder. Without --out it goes to ~/.cache/moemesh (reused if "
        "already there), where `moemesh up` finds it.",
    )
    p.add_argument("--out", default=None, help="folder to write instead of the cache")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the recipe's, 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from libs.demo.cache import ensure_demo_model
    from libs.demo.train import TrainSettings, build_demo_model

    settings = TrainSettings()
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        settings = replace(settings, steps=args.steps)
    if args.threads is not None:
        settings = replace(settings, threads=max(1, args.threads))
    path = build_demo_model(Path(args.out), settings) if args.out else ensure_demo_model(settings)
    metrics = json.loads((path / "training.json").read_text())
    held = metrics["held_out"]
    print(
        f"demo model in {path}: held-out loss {held['loss']:.3f} (perplexity {held['ppl']:.1f}), "
        f"trained in {metrics['train_seconds']:.0f} s"
    )
    return 0
