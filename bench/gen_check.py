"""`moemesh generate` on CPU and on CUDA with the same tiny checkpoint: greedy text must match (device check,
without the mesh's packages: only the generate and tiny-model subcommands are loaded)."""

import argparse
import contextlib
import io
import sys

from libs.cli import generate, tiny_model


def cli(argv: list[str]) -> str:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    generate.add_parser(sub)
    tiny_model.add_parser(sub)
    args = p.parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args.func(args)
    return out.getvalue()


if __name__ == "__main__":
    folder = sys.argv[1]
    cli(["tiny-model", "--out", folder])
    texts = {d: cli(["generate", "--model", folder, "--prompt", "Hello there", "--max-tokens", "24", "--ignore-eos",
                     "--device", d]) for d in ("cpu", "cuda")}  # fmt: skip
    print("cpu :", repr(texts["cpu"]))
    print("cuda:", repr(texts["cuda"]))
    print("GENERATE_SAME" if texts["cpu"] == texts["cuda"] else "GENERATE_DIFFERS")
