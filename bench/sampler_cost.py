"""The engine's sampling path per decode step, part by part, at B rows over DeepSeek-V3's vocabulary (129,280).

    python -m bench.sampler_cost                       # CUDA: B=256, CUDA events
    python -m bench.sampler_cost --device cpu --batch 4 --iters 3   # the CPU smoke run

Every row times the engine's own code (libs/engine/sampling.py, libs/engine/logits_processors.py) on random
logits [B, V], B requests each with a 512-token prompt and 64 output tokens already accepted, median of
--iters after warm-up; on CUDA each call is bracketed by CUDA events (a call that reads tokens back to the
host includes that sync, as the engine's step does), on the CPU by perf_counter.
- sample_one_pass: `sample` with keys, temperature 0.7 (the decode path: one Triton Gumbel-max pass; CUDA only)
- sample_greedy, sample_exact_temperature, sample_exact_top_p_top_k: the exact sampler (temperature;
  temperature + top-k 50 + top-p 0.95) with each row's own generator
- apply_penalties / apply_logit_bias / apply_min_tokens / apply_grammar_mask / apply_all: `LogitsProcessors.apply`
  with every row using repetition + frequency + presence penalties; a 16-entry logit_bias; min_tokens
  (EOS masked); a grammar; all of them. The grammar rows stand in a host bitmask of xgrammar's layout
  (random, half the vocabulary allowed) for the matcher's fill, so they time the copy, unpack and mask on
  the device without xgrammar; grammar_fill_host times xgrammar's real fill for B JSON-schema matchers
  (the tiny checkpoint's tokenizer padded to V) and is left out when xgrammar or tokenizers is missing.
- accept_counts: `accept`, the per-step count update of the penalized rows.
- step_off / step_all_on: a whole sampling step as the engine runs it (apply + sample + accept) with no
  processing vs everything on.
Writes bench/results/sampler_cost-<time>.json (or under $OUT): one record, `benchmark` "sampler_cost".
Imports torch (and triton on CUDA) only, plus xgrammar and tokenizers when they are installed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.harness import write_results
from libs.engine.logits_processors import GuidedSpec, LogitsProcessors
from libs.engine.sampling import SamplingParams, make_generator, sample

V = 129_280
EOS = 1
SCHEMA = '{"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}, "required": ["city", "n"]}'


@dataclass
class Seq:
    rid: str
    output_ids: list[int] = field(default_factory=list)


class _AnyToken:
    """A grammar matcher that accepts every token (the bitmask stand-in's partner)."""

    def is_terminated(self) -> bool:
        return False

    def accept_token(self, token: int) -> bool:
        return True


class _StandInGrammar:
    """The GrammarBackend interface with a fixed host bitmask in xgrammar's layout instead of a fill."""

    def __init__(self, batch: int, seed: int = 0) -> None:
        words = (V + 31) // 32
        gen = torch.Generator().manual_seed(seed)
        self.bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
        if torch.cuda.is_available():  # as the engine's own buffers (logits_processors.HostBitmasks)
            self.bitmask = self.bitmask.pin_memory()

    def matcher(self, spec: GuidedSpec) -> _AnyToken:
        return _AnyToken()

    def fill_bitmask(self, matchers: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.bitmask[: len(matchers)]  # its own (pinned) rows: what a fill into `out` leaves there


def time_ms(fn: Callable[[], object], device: str, iters: int) -> float:
    for _ in range(min(3, iters)):  # warm-up: Triton compiles, allocator caches
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 4)


def processors(batch: int, device: str, params: SamplingParams) -> tuple[LogitsProcessors, list[Seq]]:
    """B requests under `params`, each with a 512-token prompt and 64 accepted output tokens."""
    procs = LogitsProcessors(V, device, [EOS], tokenizer=None)
    if params.guided is not None:
        procs._grammars = _StandInGrammar(batch)
    seqs = [Seq(f"r{i}") for i in range(batch)]
    gen = torch.Generator().manual_seed(1)
    for s in seqs:
        procs.add(s.rid, torch.randint(2, V, (512,), generator=gen).tolist(), params)
    for _ in range(64):
        toks = torch.randint(2, V, (batch,), generator=gen).tolist()
        procs.accept(seqs, toks)
        for s, t in zip(seqs, toks, strict=True):
            s.output_ids.append(t)
    return procs, seqs


def processing_params() -> dict[str, SamplingParams]:
    base = {"max_tokens": 4096, "temperature": 0.7}
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    bias = {"logit_bias": {t: (-1.0) ** t * 2.0 for t in range(1000, 1016)}}
    guided = {"guided": GuidedSpec("json", SCHEMA)}
    return {
        "penalties": SamplingParams(**base, **penalties),
        "logit_bias": SamplingParams(**base, **bias),
        "min_tokens": SamplingParams(**base, min_tokens=128),
        "grammar_mask": SamplingParams(**base, **guided),
        "all": SamplingParams(**base, **penalties, **bias, min_tokens=128, **guided),
    }


def sampler_rows(logits: torch.Tensor, device: str, iters: int) -> dict[str, float]:
    b = logits.shape[0]
    gens = [make_generator(i, device) for i in range(b)]
    keys = [(i, 600) for i in range(b)]
    temp = [SamplingParams(temperature=0.7)] * b
    rows = {}
    if device == "cuda":
        rows["sample_one_pass"] = time_ms(lambda: sample(logits, temp, gens, keys), device, iters)
    rows["sample_greedy"] = time_ms(
        lambda: sample(logits, [SamplingParams(temperature=0.0)] * b, gens), device, iters
    )
    rows["sample_exact_temperature"] = time_ms(lambda: sample(logits, temp, gens), device, iters)
    filtered = [SamplingParams(temperature=0.7, top_k=50, top_p=0.95)] * b
    rows["sample_exact_top_p_top_k"] = time_ms(lambda: sample(logits, filtered, gens), device, iters)
    return rows


def processing_rows(logits: torch.Tensor, device: str, iters: int) -> dict[str, float]:
    b = logits.shape[0]
    gens = [make_generator(i, device) for i in range(b)]
    keys = [(i, 600) for i in range(b)]  # as the engine passes them (the CPU ignores them)
    rows = {}
    for name, params in processing_params().items():
        procs, seqs = processors(b, device, params)
        rows[f"apply_{name}"] = time_ms(lambda p=procs, s=seqs: p.apply(logits, s), device, iters)
        if name == "penalties":
            toks = list(range(2, 2 + b))
            rows["accept_counts"] = time_ms(lambda p=procs, s=seqs, t=toks: p.accept(s, t), device, iters)
        if name == "all":

            def step(p: LogitsProcessors = procs, s: list[Seq] = seqs, sp: SamplingParams = params) -> None:
                out = sample(p.apply(logits, s), [sp] * b, gens, keys, logits)
                p.accept(s, out.token_ids)

            rows["step_all_on"] = time_ms(step, device, iters)
    plain = [SamplingParams(temperature=0.7)] * b
    rows["step_off"] = time_ms(lambda: sample(logits, plain, gens, keys), device, iters)
    return rows


def grammar_fill_row(batch: int, iters: int) -> dict[str, Any]:
    """xgrammar's host fill for B fresh JSON-schema matchers, or why it was left out."""
    try:
        import tempfile

        from libs.engine.grammar import GrammarBackend
        from libs.engine.tiny import write_tiny_model
        from libs.tokenizer import Tokenizer
    except ImportError as e:
        return {"grammar_fill_host_skipped": f"{type(e).__name__}: {e}"}
    tok = Tokenizer.from_pretrained(write_tiny_model(tempfile.mkdtemp(), seed=0))
    backend = GrammarBackend(tok, V, [tok.eos_token_id])
    matchers = [backend.matcher(GuidedSpec("json", SCHEMA)) for _ in range(batch)]
    return {"grammar_fill_host": time_ms(lambda: backend.fill_bitmask(matchers), "cpu", iters)}


def run(device: str, batch: int, iters: int, dtype: torch.dtype) -> dict[str, Any]:
    logits = torch.randn(batch, V, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    record: dict[str, Any] = {
        "benchmark": "sampler_cost", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "batch": batch, "vocab": V, "logits_dtype": str(dtype).removeprefix("torch."), "iters": iters,
        "timer": "cuda_events" if device == "cuda" else "perf_counter", "torch": torch.__version__, "ms": {},
    }  # fmt: skip
    record["ms"].update(sampler_rows(logits, device, iters))
    record["ms"].update(processing_rows(logits, device, iters))
    fill = grammar_fill_row(batch, iters)
    record["ms"].update({k: v for k, v in fill.items() if not k.endswith("_skipped")})
    record.update({k: v for k, v in fill.items() if k.endswith("_skipped")})
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    record = run(args.device, args.batch, args.iters, getattr(torch, args.dtype))
    for name, ms in record["ms"].items():
        print(f"{name:28s} {ms:10.3f} ms", flush=True)
    print(write_results("sampler_cost", [record]))
    return record


if __name__ == "__main__":
    main()
