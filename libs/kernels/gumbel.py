"""Temperature sampling in one pass over the logits: Gumbel-max (argmax of logits / T + Gumbel noise, an exact
draw from softmax(logits / T)) with Philox noise keyed by each row's seed and decode position, so a replayed
graph draws fresh noise and a seeded request the same tokens whatever shares its batch. T = 0 is greedy."""

# Greedy ties go to the lowest id, as torch.argmax. It replaces the ~10 torch kernels (cast, rand, log, neg,
# log, neg, div, add, argmax) a step otherwise spends on a [B, V] fp32 copy, and gives the chosen token's
# logprob in the same pass (no log_softmax copy). Used by sampling's one-pass rows and overlapped decode.

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SEED_MIX = 1000003  # seed * this + position: distinct Philox keys per (request, position)


@triton.jit
def _gumbel_sample_kernel(
    LOGITS, TEMPS, SEEDS, POS, OUT, LOGP, V, stride_l, BLOCK: tl.constexpr, MIX: tl.constexpr,
    WANT_LP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    temp = tl.load(TEMPS + row)
    key = tl.load(SEEDS + row).to(tl.int64) * MIX + tl.load(POS + row).to(tl.int64)
    base = LOGITS + row.to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK], 0, tl.int32)
    best_x = tl.full([BLOCK], float("-inf"), tl.float32)  # the raw logit of each lane's best
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: online log-sum-exp of the raw logits
    run_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        v = start + offs
        ok = v < V
        x = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32)
        score = x
        if temp > 0:
            u = tl.rand(key, v)
            score = x / temp - tl.log(-tl.log(u))
        score = tl.where(ok, score, float("-inf"))
        better = score > best  # strict: the earliest block keeps a tie
        best_id = tl.where(better, v, best_id)
        best = tl.where(better, score, best)
        if WANT_LP:
            best_x = tl.where(better, x, best_x)
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane with nothing yet: no inf - inf
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
    top = tl.max(best, 0)
    chosen = tl.min(tl.where(best == top, best_id, V), 0)
    tl.store(OUT + row, chosen)
    if WANT_LP:
        m = tl.max(run_max, 0)
        lse = m + tl.log(tl.sum(run_sum * tl.exp(run_max - m), 0))
        x_chosen = tl.max(tl.where((best == top) & (best_id == chosen), best_x, float("-inf")), 0)
        tl.store(LOGP + row, x_chosen - lse)


def gumbel_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype, contiguous rows), temperatures [B] f32 (0: greedy), seeds [B], positions
    [B] -> token ids [B] (int64 unless `out` says otherwise). `logprobs` ([B] f32), when given, gets each chosen
    token's log-probability under the raw logits (what OpenAI reports), by an online log-sum-exp."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits need a contiguous last dimension")
    if not (temperatures.shape == seeds.shape == positions.shape == (b,)):
        raise ValueError(f"temperatures, seeds and positions must each be [{b}]")
    if logprobs is not None and (logprobs.shape != (b,) or logprobs.dtype != torch.float32):
        raise ValueError(f"logprobs must be a float32 tensor of shape [{b}]")
    out = out if out is not None else torch.empty(b, dtype=torch.int64, device=logits.device)
    if b:
        _gumbel_sample_kernel[(b,)](
            logits, temperatures, seeds, positions, out, logprobs if logprobs is not None else out, v,
            logits.stride(0), BLOCK=min(4096, triton.next_power_of_2(v)), MIX=_SEED_MIX,
            WANT_LP=logprobs is not None, num_warps=8,
        )  # fmt: skip
    return out
