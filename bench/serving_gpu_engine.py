"""serving_gpu's reference: the same requests through the in-process Engine on the same device and model,
decode tokens/s measured as the mesh's slow-down experiment measures it (libs.loadgen.slowdown): from the
moment every request is decoding, while FULL_BATCH_SHARE of them still run. On a GPU the Engine first runs
the workers' start-up warm-up (libs/worker/warmup.py), so both sides are timed with kernels compiled."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from libs.engine import Engine
from libs.engine.sampling import SamplingParams
from libs.loadgen.slowdown import FULL_BATCH_SHARE
from libs.telemetry.gc_pauses import GcPauses
from libs.worker.warmup import plan_warmup, run_warmup


def greedy(engine: Engine, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """One prompt at a time, as serving_gpu sends them through the mesh: on a GPU the batch a request
    shares picks the GEMM kernels (per bucket of rows), so a batch of three would not be comparable."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [engine.generate([list(p)], params)[0].token_ids for p in prompts]


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def full_batch_decode(engine: Engine, prompts: Sequence[list[int]], output_len: int) -> dict[str, Any]:
    """Every prompt at once (greedy, ignore_eos); tokens/s over the steps after each request produced its
    first token and before fewer than FULL_BATCH_SHARE of them still run, and the whole run's rate; each
    window step's outputs and milliseconds, and the garbage collections of the window."""
    n = len(prompts)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", list(p), params)
    keep = math.ceil(FULL_BATCH_SHARE * n)
    started: set[str] = set()
    finished, total = 0, 0
    t0 = time.perf_counter()
    full_from: float | None = None
    window_tokens, window_end, steps, outputs = 0, 0.0, [], []
    gcs = GcPauses(keep=True)  # the window's collections, (generation, ms) each
    try:
        while engine.has_unfinished():
            before = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            produced = sum(len(o.token_ids) for o in outs)
            total += produced
            in_window = full_from is not None and n - finished >= keep
            started.update(o.rid for o in outs if o.token_ids)
            finished += sum(1 for o in outs if o.finished)
            if in_window:
                window_tokens, window_end = window_tokens + produced, now
                steps.append(now - before)
                outputs.append(len(outs))
            elif full_from is not None:
                gcs.uninstall()  # the window is over
            if full_from is None and len(started) == n:
                _sync(engine)
                full_from = time.perf_counter()
                gcs.install()
    finally:
        gcs.uninstall()
    _sync(engine)
    duration = time.perf_counter() - t0
    window = (window_end - full_from) if full_from is not None and window_end > full_from else 0.0
    return {
        "requests": n,
        "output_len": output_len,
        "duration_s": duration,
        "output_tok_s_whole_run": total / duration,
        "full_batch_tok_s": window_tokens / window if window else None,
        "full_batch_window_s": window,
        "full_batch_steps": len(steps),
        "step_ms_median": 1000 * sorted(steps)[len(steps) // 2] if steps else None,
        "window_steps": {"outputs": outputs, "ms": [round(1000 * x, 2) for x in steps]},
        "window_gc": [list(g) for g in gcs.seen or []],
    }


def warm_up(engine: Engine, engine_kwargs: dict[str, Any]) -> float:
    """The decode worker's start-up warm-up on this Engine (both prefill lengths and decode graph sizes)."""
    st = engine.stats()
    plan = plan_warmup(
        engine_kwargs["max_prefill_tokens"], engine_kwargs["max_num_seqs"], page_size=engine.page_size,
        free_pages=st["free_pages"], context_len=engine.config.max_position_embeddings, decode=True,
    )  # fmt: skip
    return run_warmup(engine, plan).seconds


def engine_reference(
    model_dir: str, device: str, dtype: str, engine_kwargs: dict[str, Any],
    prompt_sets: Sequence[Sequence[list[int]]], output_len: int, greedy_prompts: Sequence[list[int]],
    greedy_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """The first prompt set's full-batch run as the record's Engine phase; with more sets (the mesh's
    repeats' prompts, one Engine: its pool fills with cached prompts as the decode worker's does) each
    run's rate in `repeats` and `full_batch_tok_s` their median."""
    if device == "cpu":
        torch.set_num_threads(1)  # as each worker process runs (WorkerSettings.torch_threads)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model_dir, device=device, dtype=dtype, **engine_kwargs)
    load_s = time.perf_counter() - t0
    warmup_s = warm_up(engine, engine_kwargs) if device.startswith("cuda") else 0.0
    texts = greedy(engine, greedy_prompts, greedy_tokens)
    runs = [full_batch_decode(engine, prompts, output_len) for prompts in prompt_sets]
    out = runs[0]
    if len(runs) > 1:
        rates = [r["full_batch_tok_s"] for r in runs]
        out["repeats"] = [
            {k: r[k] for k in ("full_batch_tok_s", "full_batch_window_s", "step_ms_median")} for r in runs
        ]
        out["full_batch_tok_s"] = statistics.median(x for x in rates if x) if any(rates) else None
    out |= {"load_s": load_s, "warmup_s": warmup_s, "greedy": texts, "stats_after": engine.stats()}
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out
