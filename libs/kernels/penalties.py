"""vLLM's repetition, frequency and presence penalties as one Triton pass over the penalized rows of float32
logits (one program per (row, vocabulary block)); the engine takes it on CUDA and logits_processors'
`penalties_torch` elsewhere."""

# Legend: P penalized rows, C count-table rows, V vocabulary.
#   seen:  x > 0 -> x / repetition, else x * repetition          (seen: the token is in the prompt or output)
#   then:  x -= frequency * count;  x -= presence * (count > 0)   (count: the token's output occurrences)
# One read of logits, counts and seen flags and one write per element, where separate torch ops make many
# [P, V] passes (gathers, masks, temporaries, the scatter back). Tests run it under Triton's interpreter.

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _penalties_kernel(
    OUT, COUNTS, SEEN, ROWS, SLOTS, REP, FREQ, PRES, V, stride_o, stride_c, stride_s, BLOCK: tl.constexpr
):
    p = tl.program_id(0)
    row = tl.load(ROWS + p).to(tl.int64)
    slot = tl.load(SLOTS + p).to(tl.int64)
    rep, freq, pres = tl.load(REP + p), tl.load(FREQ + p), tl.load(PRES + p)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(OUT + row * stride_o + offs, mask=mask, other=0.0)
    count = tl.load(COUNTS + slot * stride_c + offs, mask=mask, other=0.0)
    seen = tl.load(SEEN + slot * stride_s + offs, mask=mask, other=0) != 0
    r = tl.where(seen, rep, 1.0)
    x = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
    x = x - freq * count
    x = x - pres * (count > 0).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, x, mask=mask)


def apply_penalties(
    out: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
    rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor,
) -> None:  # fmt: skip
    """In place on out [S, V] float32: rows [P] of out take the penalties of count-table rows slots [P]
    (counts [C, V] float32, seen [C, V] bool) with per-row rep, freq, pres [P] float32 (all on out's device)."""
    if out.dtype != torch.float32 or out.stride(-1) != 1 or counts.shape[-1] != out.shape[-1]:
        raise ValueError("apply_penalties needs float32 logits [S, V] with contiguous rows and [C, V] counts")
    p, v = rows.shape[0], out.shape[1]
    if p == 0:
        return
    _penalties_kernel[(p, triton.cdiv(v, BLOCK))](
        out, counts, seen.view(torch.uint8), rows, slots, rep, freq, pres, v,
        out.stride(0), counts.stride(0), seen.stride(0), BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
