"""Worker warm-up before the first heartbeat: a few forwards through the engine's own `generate` so Triton
compiles, FlashInfer's JIT and decode CUDA-graph captures happen while the mesh comes up, not on a user's
first requests. `plan_warmup` is pure; `run_warmup` runs it and leaves the pool as it found it."""

# Kernel choices come from the tuning tables or the fixed default, never timed here (tuning is `moemesh
# tune`'s job; libs/kernels/gemm_tuning.py). The mesh counts a worker ready at its first heartbeat, sent
# only after start_engine returns; /ready names the stage meanwhile. A page still held after warm-up is an
# error, not a slow leak found later.

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from libs.engine.batcher import pages_for
from libs.engine.cuda_graph import capture_sizes
from libs.engine.protocol import EngineLike
from libs.engine.sampling import SamplingParams
from libs.kernels import gemm_tuning

log = logging.getLogger("moemesh.worker.warmup")

DECODE_TOKENS = 3  # tokens per decode-batch request: the first from prefill, then a capture and a replay;
# every other request of a batch makes one more, so the batch's last step changes size: the overlapped
# decode's gather of the carried rows' tokens (decode_pipeline._inputs) runs before the first served finish
FIRST_TOKEN = 3  # prompt ids from here up: clear of the usual special ids, inside every vocabulary here


@dataclass(frozen=True)
class WarmupPlan:
    """What to run: one prompt of each `prefill_lens` alone (a forward of every bucket of M up to the worker's
    max_prefill_tokens), then each of `decode_batches` one-token prompts together per copy, decoded
    DECODE_TOKENS - 1 steps (each captured decode graph size, with its GEMMs, on every EP rank)."""

    prefill_lens: tuple[int, ...]
    # the EP engine places each prompt on the least busy rank, so `copies` x b prompts give each rank b
    decode_batches: tuple[int, ...]
    copies: int = 1  # prompts per length: one per EP rank, so every rank runs it


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    prompts: int  # prompts run (each at least one forward)
    plan: WarmupPlan
    stages: tuple[tuple[str, float], ...] = ()  # (stage, seconds) in the order run
    defaulted: int = 0  # GEMM kernel choices no tuning table answered (the fixed default taken)


def warmup_enabled(mode: str, device: str, engine: str) -> bool:
    """auto: on for a model on a GPU (where first-use compilation and graph capture take minutes), off on the CPU
    (nothing is tuned there; tests stay fast) and for the timing-model engine."""
    if mode == "auto":
        return device.startswith("cuda") and engine == "model"
    return mode == "on"


def plan_warmup(
    max_prefill_tokens: int, max_num_seqs: int, *, page_size: int, free_pages: int, context_len: int,
    decode: bool, copies: int = 1,
) -> WarmupPlan:  # fmt: skip
    """Prompt lengths 1, 2, 4, .. up to max_prefill_tokens and max_prefill_tokens itself, within the context
    and the pool (each prompt runs alone, `copies` at once); with `decode`, the decode-graph batch sizes
    that fit in the pool."""
    room = min(context_len - 1, (free_pages // max(copies, 1)) * page_size - 1)
    top = min(max_prefill_tokens, room)
    lens = sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | ({top} if top >= 1 else set()))
    per_seq = pages_for(2 + DECODE_TOKENS, page_size) * max(copies, 1)  # free_pages: all ranks' pools
    batches = [b for b in capture_sizes(max_num_seqs) if b * per_seq <= free_pages] if decode else []
    return WarmupPlan(prefill_lens=tuple(lens), decode_batches=tuple(batches), copies=copies)


def run_warmup(engine: EngineLike, plan: WarmupPlan) -> WarmupReport:
    """The plan through `engine.generate` (greedy, ignore_eos), then the prefix cache emptied. Call it on the
    engine's thread, before any request. RuntimeError naming the step that failed (a worker that cannot run
    its own max_prefill_tokens or decode batch should not start), or when pages stay held afterwards."""
    t0, defaulted0 = time.perf_counter(), len(gemm_tuning.DEFAULTED)
    span = max(engine.config.vocab_size - FIRST_TOKEN, 1)
    stages: list[tuple[str, float]] = []
    prompts = 0
    prefill_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in plan.prefill_lens:
        batch = [[FIRST_TOKEN + (7 * i + 13 * c) % span for i in range(n)] for c in range(plan.copies)]
        prompts += _stage(engine, batch, prefill_only, f"a prefill of {n} tokens", stages)
    decoding = [
        SamplingParams(max_tokens=DECODE_TOKENS + k, temperature=0.0, ignore_eos=True) for k in (0, 1)
    ]
    for b in plan.decode_batches:
        batch = [[FIRST_TOKEN + i % span] for i in range(b * plan.copies)]
        params = [decoding[i % 2] for i in range(len(batch))]
        prompts += _stage(engine, batch, params, f"a decode batch of {b}", stages)
    engine.flush_prefix_cache()
    st = engine.stats()
    if st.get("used_pages", 0) or st.get("running", 0) or st.get("waiting", 0):
        raise RuntimeError(f"warm-up left work or pages behind: {st}")
    defaulted = len(gemm_tuning.DEFAULTED) - defaulted0
    if defaulted:
        log.info("warm-up: %d GEMM kernel choices had no tuning-table entry and took the default "
                 "(`moemesh tune` writes one)", defaulted)  # fmt: skip
    return WarmupReport(
        seconds=time.perf_counter() - t0,
        prompts=prompts,
        plan=plan,
        stages=tuple(stages),
        defaulted=defaulted,
    )


def _stage(
    engine: EngineLike, batch: list[list[int]], params: SamplingParams | list[SamplingParams], what: str,
    stages: list[tuple[str, float]],
) -> int:  # fmt: skip
    """One stage through `engine.generate`, its seconds appended to `stages` and logged."""
    t0 = time.perf_counter()
    try:
        engine.generate(batch, params)
    except Exception as err:
        raise RuntimeError(f"warm-up failed on {what}: {type(err).__name__}: {err}") from err
    seconds = time.perf_counter() - t0
    stages.append((what, seconds))
    log.info("warm-up: %s: %.2f s", what, seconds)
    return len(batch)
