"""The `moemesh` command: one argparse subcommand per module in COMMANDS. Each exposes
`add_parser(subparsers)`, which sets `func=run` on its subparser; `main` exits with `args.func(args)`.
To add a command, write `libs/cli/<cmd>.py` and append its module name to COMMANDS."""

# Command modules import heavy things (torch, the engine, services) inside `run`, so `moemesh --help` is fast.

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: list[str] = [
    "libs.cli.bench",
    "libs.cli.demo_model",
    "libs.cli.generate",
    "libs.cli.kv_store_master",
    "libs.cli.serve",
    "libs.cli.tiny_model",
    "libs.cli.tune",
    "libs.cli.up",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moemesh", description="Serve DeepSeek-V3-class MoE models as a mesh of services."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as e:  # bad input the command could not act on: say why, no traceback
        print(f"moemesh {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
