"""Where two-batch overlap splits a forward into its two micro-batches (libs/engine/two_batch_overlap.py runs
them; the attention backends plan one kernel per part with the same split): pure, no engine imports."""

from __future__ import annotations

from collections.abc import Sequence


def split_index(extend_lens: Sequence[int]) -> int:
    """Sequences in micro-batch A: half of a decode batch, else the first sequences holding about half the
    tokens (as SGLang's `_split_array_by_half_sum`). May be 0 or S only when S is 1."""
    s = len(extend_lens)
    if s <= 1:
        return s
    if all(n == 1 for n in extend_lens):
        return s // 2
    total, acc = sum(extend_lens), 0
    best, best_gap = 1, None
    for i in range(1, s):
        acc += extend_lens[i - 1]
        gap = abs(total - 2 * acc)
        if best_gap is None or gap < best_gap:
            best, best_gap = i, gap
    return best


def decode_round_tokens(max_num_seqs: int, two_batch_overlap: bool) -> int:
    """The most tokens one EP round of a decode forward carries: the whole batch, or with two-batch overlap its
    larger micro-batch (split_index puts the odd sequence in B: ceil of half)."""
    return -(-max_num_seqs // 2) if two_batch_overlap else max_num_seqs
