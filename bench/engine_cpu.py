"""CPU throughput of the engine on the tiny DeepSeek-V3 checkpoint: prefill and decode tokens/s at batch
1, 8 and 32, through the public Engine API (scheduling, paging and sampling included).

    python -m bench.engine_cpu [--batches 1,8,32 --prompt-len 128 --decode-prompt-len 32 --decode-tokens 64]

Prefill: B prompts of --prompt-len random tokens, prefix cache off, max_tokens 1 (one scheduling step
when B * prompt_len fits max_prefill_tokens, chunked otherwise); tokens/s = B * prompt_len / time.
Decode: B prompts of --decode-prompt-len tokens are prefilled first (not timed), then the timed steps
produce the remaining --decode-tokens - 1 tokens each, greedy, ignore_eos; tokens/s = generated / time.
Each number is the best of --repeats runs after a warm-up. Writes bench/results/engine_cpu.json (or
$OUT/engine_cpu.json when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import cpu_environment
from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=gen).tolist()


def prefill_rate(engine: Engine, batch: int, length: int) -> float:
    prompts = _prompts(batch, length, engine.config.vocab_size, seed=batch)
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return batch * length / (time.perf_counter() - start)


def decode_rate(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, engine.config.vocab_size, seed=1000 + batch)):
        engine.add_request(f"d{i}", p, params)
    while any(not r.output_ids for r in engine.requests.values()):  # prefill (and first tokens), untimed
        engine.step()
    produced, start = 0, time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp) / "tiny", seed=0)
        engine = Engine.from_pretrained(
            path,
            max_num_seqs=max(batches),
            max_prefill_tokens=args.max_prefill_tokens,
            enable_prefix_cache=False,
        )
    cfg = engine.config
    rows = []
    prefill_rate(engine, 2, 16)  # warm-up
    decode_rate(engine, 2, 8, 4)
    for b in batches:
        pre = max(prefill_rate(engine, b, args.prompt_len) for _ in range(args.repeats))
        dec = max(
            decode_rate(engine, b, args.decode_prompt_len, args.decode_tokens) for _ in range(args.repeats)
        )
        rows.append({"batch": b, "prefill_tokens_per_s": round(pre, 1), "decode_tokens_per_s": round(dec, 1)})
        print(f"batch {b:3d}: prefill {pre:10.1f} tok/s   decode {dec:10.1f} tok/s", flush=True)
    return {
        "benchmark": "engine_cpu",
        "command": "python -m bench.engine_cpu "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": {
            "checkpoint": "libs.engine.tiny.write_tiny_model(seed=0)",
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "vocab_size": cfg.vocab_size,
            "dtype": "float32",
        },
        "settings": vars(args) | {"page_size": engine.page_size},
        "environment": cpu_environment(load_before),
        "results": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    result = run(args)
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "engine_cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
