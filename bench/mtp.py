"""MTP speculative decoding on the demo model on CPU: acceptance rate and decode tokens/s with and without
MTP at batch 1, 8 and 32, through the Engine API (scheduling, paging, sampling, verification included).

    python -m bench.mtp [--batches 1,8,32 --ks 0,1,2,3 --decode-tokens 64 --temperature 0]
    python -m bench.mtp --gpu [--layers 4 --ctx 1000 --attn triton --batches 1,8,32 --ks 1,2,3]
    python -m bench.mtp --host [--batches 1,8,32 --ks 1,3 --host-steps 40]

--host: the host time of one MTP step on CPU (time outside forwards, host reads of tensor values) on the
GPU's row/graph path (bench/mtp_host.py), written to bench/results/mtp-host-<time>.json.

--gpu: draft + verify step time at DeepSeek-V3 width with random FP8 weights (bench/mtp_gpu.py), written
to bench/results/mtp-gpu-<attn>-<time>.json (or under $OUT).

Prompts are the first --prompt-len tokens of held-out pydoc paragraphs (text the model never trained
on). Per (batch, k): B requests are prefilled (not timed), then the timed steps produce the rest of
--decode-tokens each, ignore_eos, request i seeded with i; tokens/s = generated / wall time, and per
second of this process's CPU time (steadier on a shared machine: one thread), each the best of --repeats; acceptance = accepted drafts / drafted;
tokens per verify = 1 + accepted / verifying forwards. k 0 is the plain Engine. Writes
bench/results/mtp.json (or $OUT/mtp.json). Trains the demo model first if it is not cached (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.harness import cpu_environment
from libs.demo.cache import ensure_demo_model
from libs.demo.pydoc_corpus import load_corpus
from libs.engine import Engine, SamplingParams
from libs.engine.speculative import MTPEngine


def _prompts(engine: Engine, batch: int, length: int) -> list[list[int]]:
    assert engine.tokenizer is not None
    paragraphs = [p for p in load_corpus().held_out if len(p) > 8 * length]
    return [engine.tokenizer.encode(paragraphs[i % len(paragraphs)])[:length] for i in range(batch)]


def decode_run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, int]:
    """-> (tokens per wall second, tokens per CPU second of this process, tokens)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, replace(params, seed=i))
    while any(not r.output_ids for r in engine.requests.values()):  # prefill (and first tokens), untimed
        engine.step()
    produced, start, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start), produced / (time.process_time() - cpu), produced


def measure(path: Path, k: int, batch: int, args: argparse.Namespace) -> dict:
    kw: dict[str, Any] = dict(max_num_seqs=max(batch, 1), enable_prefix_cache=False)
    engine = Engine.from_pretrained(path, **kw) if k == 0 else MTPEngine.load(path, mtp_k=k, **kw)
    params = SamplingParams(
        max_tokens=args.decode_tokens, temperature=args.temperature, ignore_eos=True, seed=0
    )
    decode_run(engine, _prompts(engine, 2, 8), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    rates, cpu_rates = [], []
    for _ in range(args.repeats):  # the same seeds each time: the same tokens, drafts and acceptances
        if isinstance(engine, MTPEngine):
            engine.num_drafted = engine.num_accepted = engine.num_verified = 0
        rate, cpu_rate, produced = decode_run(engine, _prompts(engine, batch, args.prompt_len), params)
        rates.append(rate)
        cpu_rates.append(cpu_rate)
    row = {
        "batch": batch, "k": k, "decode_tokens_per_s": round(max(rates), 1),
        "decode_tokens_per_cpu_s": round(max(cpu_rates), 1), "tokens": produced,
    }  # fmt: skip
    if isinstance(engine, MTPEngine):
        row["acceptance_rate"] = round(engine.acceptance_rate, 3)
        row["tokens_per_verify"] = round(1 + engine.num_accepted / max(engine.num_verified, 1), 3)
    return row


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else ensure_demo_model()
    load_before = os.getloadavg()[0]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for k in [int(k) for k in args.ks.split(",")]:
            row = measure(path, k, batch, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["batch"]: r for r in rows if r["k"] == 0}
    for r in rows:
        if r["k"] and r["batch"] in base:
            r["speedup"] = round(r["decode_tokens_per_s"] / base[r["batch"]]["decode_tokens_per_s"], 2)
            b = base[r["batch"]]["decode_tokens_per_cpu_s"]
            r["speedup_cpu_time"] = round(r["decode_tokens_per_cpu_s"] / b, 2)
    return {
        "benchmark": "mtp",
        "command": "python -m bench.mtp "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": {"checkpoint": str(path.name), "training": json.loads((path / "training.json").read_text())},
        "settings": vars(args),
        "environment": cpu_environment(load_before),
        "results": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="", help="checkpoint folder with an MTP layer (default: the demo model)"
    )
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ks", default="0,1,2,3", help="draft tokens per step; 0 is the plain engine")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--gpu", action="store_true", help="V3-width step times on a GPU (bench/mtp_gpu.py)")
    ap.add_argument("--layers", type=int, default=4, help="--gpu: decoder layers (3 dense, then MoE)")
    ap.add_argument("--ctx", type=int, default=1000, help="--gpu: context tokens per request")
    ap.add_argument("--attn", choices=["auto", "triton", "flashinfer"], default="triton", help="--gpu")
    ap.add_argument("--warmup", type=int, default=3, help="--gpu: untimed steps (graph captures)")
    ap.add_argument("--iters", type=int, default=10, help="--gpu: timed steps")
    ap.add_argument("--host", action="store_true", help="host ms per MTP step on CPU (bench/mtp_host.py)")
    ap.add_argument("--host-steps", type=int, default=40, help="--host: timed steps")
    args = ap.parse_args()
    if args.host:
        from bench import mtp_host
        from bench.harness import write_results

        result = mtp_host.run(args)
        result["command"] = "python -m bench.mtp --host " + f"--batches {args.batches} --ks {args.ks}"
        print("wrote", write_results("mtp-host", [result]))
        return
    if args.gpu:
        from bench import mtp_gpu

        mtp_gpu.main(args)
        return
    result = run(args)
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / ("mtp.json" if args.temperature == 0 else f"mtp_t{args.temperature:g}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
