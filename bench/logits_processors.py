"""Sampler cost per decode step with and without logits processing, at DeepSeek-V3's vocabulary (129,280).

    python -m bench.logits_processors [--device cpu|cuda --batches 1,16,64,256 --steps 20]

For each batch size B: random fp32 logits [B, V]; B requests registered with a 512-token prompt and 64
output tokens already accepted. Timed per step (median of --steps): `sample` alone (temperature 1, the
common case: `apply` returns the logits untouched), then `apply` + `sample` + `accept` with every request
using repetition/frequency/presence penalties, a 4-entry logit_bias and min_tokens, then with every
request under a JSON-schema grammar (xgrammar bitmask filled on the host, applied on the device). The
grammar rows use the tiny checkpoint's 1,024-token tokenizer padded to V, so the host bitmask fill is
cheaper than with DeepSeek-V3's real vocabulary. Writes bench/results/logits_processors-<time>.json
(or under $OUT).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.harness import write_results
from libs.engine.logits_processors import GuidedSpec, LogitsProcessors
from libs.engine.sampling import SamplingParams, make_generator, sample
from libs.engine.tiny import write_tiny_model
from libs.tokenizer import Tokenizer

V = 129_280
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "n": {"type": "integer"}},
    "required": ["city", "n"],
}


@dataclass
class Seq:
    rid: str
    output_ids: list[int] = field(default_factory=list)


def _ms(fn: Callable[[], object], device: str, steps: int) -> float:
    times = []
    for _ in range(steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[2:])


def run(batch: int, device: str, steps: int, tok: Tokenizer) -> dict:
    logits = torch.randn(batch, V, device=device)
    gens = [make_generator(i, device) for i in range(batch)]
    plain = [SamplingParams(max_tokens=1024)] * batch
    pen = SamplingParams(
        max_tokens=1024, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
        logit_bias={1: 2.0, 2: -2.0, 3: 1.0, 4: -1.0}, min_tokens=128,
    )  # fmt: skip
    gram = SamplingParams(max_tokens=1024, guided=GuidedSpec("json", json.dumps(SCHEMA)))
    out = {"batch": batch, "device": device, "vocab": V}
    out["sample_only_ms"] = _ms(lambda: sample(logits, plain, gens), device, steps)
    for name, params in (("penalties_bias_min_tokens", pen), ("json_schema", gram)):
        procs = LogitsProcessors(V, device, [1], tok)
        seqs = [Seq(f"r{i}") for i in range(batch)]
        for s in seqs:
            procs.add(s.rid, torch.randint(5, V, (512,)).tolist(), params)
        if name != "json_schema":
            for _ in range(64):
                toks = torch.randint(5, V, (batch,)).tolist()
                procs.accept(seqs, toks)
                for s, t in zip(seqs, toks, strict=True):
                    s.output_ids.append(t)

        def step(procs=procs, seqs=seqs, params=params, counts=name != "json_schema") -> None:
            res = sample(procs.apply(logits, seqs), [params] * batch, gens, logits)
            if counts:  # a grammar's state would advance; its mask cost is the same each step
                procs.accept(seqs, res.token_ids)

        out[f"{name}_ms"] = _ms(step, device, steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    tok = Tokenizer.from_pretrained(write_tiny_model(tempfile.mkdtemp(), seed=0))
    records = []
    for b in (int(x) for x in args.batches.split(",")):
        rec = run(b, args.device, args.steps, tok)
        print(rec, flush=True)
        records.append(rec)
    print(write_results("logits_processors", records))


if __name__ == "__main__":
    main()
