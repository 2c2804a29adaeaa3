"""Temperature sampling in one pass over the logits: Gumbel-max (argmax of logits / T + Gumbel noise draws
from softmax(logits / T) exactly), noise from Philox keyed by each row's seed and decode position, so a
captured decode step replayed at the next position draws fresh noise and a seeded request draws the same
tokens whatever shares its batch. Temperature 0 is greedy (ties to the lowest id, as torch.argmax).

Replaces the ~10 torch kernels (cast, rand, log, neg, log, neg, div, add, argmax) a decode step otherwise
spends on a [B, V] fp32 copy of the logits. Only bench.decode_rank uses it today; the engine samples with
libs.engine.sampling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SEED_MIX = 1000003  # seed * this + position: distinct Philox keys per (request, position)


@triton.jit
def _gumbel_sample_kernel(
    LOGITS, TEMPS, SEEDS, POS, OUT, V, stride_l, BLOCK: tl.constexpr, MIX: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    temp = tl.load(TEMPS + row)
    key = tl.load(SEEDS + row).to(tl.int64) * MIX + tl.load(POS + row).to(tl.int64)
    base = LOGITS + row.to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, V, BLOCK):
        v = start + offs
        ok = v < V
        score = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32)
        if temp > 0:
            u = tl.rand(key, v)
            score = score / temp - tl.log(-tl.log(u))
        score = tl.where(ok, score, float("-inf"))
        better = score > best  # strict: the earliest block keeps a tie
        best_id = tl.where(better, v, best_id)
        best = tl.where(better, score, best)
    top = tl.max(best, 0)
    tl.store(OUT + row, tl.min(tl.where(best == top, best_id, V), 0))


def gumbel_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype, contiguous rows), temperatures [B] f32 (0: greedy), seeds [B] and
    positions [B] integers -> token ids [B] (int64 unless `out` says otherwise)."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits need a contiguous last dimension")
    if not (temperatures.shape == seeds.shape == positions.shape == (b,)):
        raise ValueError(f"temperatures, seeds and positions must each be [{b}]")
    out = out if out is not None else torch.empty(b, dtype=torch.int64, device=logits.device)
    if b:
        _gumbel_sample_kernel[(b,)](
            logits, temperatures, seeds, positions, out, v, logits.stride(0),
            BLOCK=min(4096, triton.next_power_of_2(v)), MIX=_SEED_MIX, num_warps=8,
        )  # fmt: skip
    return out
