"""`moemesh generate --model DIR --prompt TEXT [...]`: offline generation with the engine, streamed to stdout."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a checkpoint folder with the engine (no services, no bus)",
        description="Tokenize the prompt with the folder's tokenizer, run the engine in this process and "
        "stream the text to stdout; a summary (tokens, finish reason, tokens/s) goes to stderr.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as one user turn of the chat template"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument(
        "--quantization", default="auto", choices=("auto", "fp8", "none"),
        help="FP8 checkpoints: keep FP8 on CUDA (auto), always (fp8), or dequantize to --dtype (none)",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from libs.engine import Engine, SamplingParams
    from libs.tokenizer import IncrementalDetokenizer

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, max_num_seqs=1, quantization=args.quantization
    )
    tok = engine.tokenizer
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer.json; generate needs one to read the prompt")
    if args.chat:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    engine.add_request("cli", prompt_ids, params)
    start, n, reason = time.perf_counter(), 0, None
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.token_ids)
            sys.stdout.write(detok.add(out.token_ids))
            sys.stdout.flush()
            reason = out.finish_reason or reason
    sys.stdout.write(detok.flush() + "\n")
    secs = time.perf_counter() - start
    print(
        f"[{len(prompt_ids)} prompt tokens, {n} generated, finish_reason={reason}, {n / secs:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0
