"""The fused penalty pass (libs/kernels/penalties.py) against the engine's torch form and vLLM's formula:
rows in any order, some logits -inf (masked before), count-table rows other than the logits rows.

Without CUDA the kernel runs under Triton's interpreter (this directory's conftest)."""

from __future__ import annotations

import pytest
import torch

from libs.engine.logits_processors import penalties_torch
from libs.kernels.penalties import BLOCK, apply_penalties


def _vllm(logits, counts, seen, rep, freq, pres):
    """vLLM's apply_penalties on whole rows, as it is written there."""
    logits = logits.clone()
    r = torch.where(seen, rep[:, None], 1.0)
    pos = logits > 0
    logits[pos] /= r[pos]
    logits[~pos] *= r[~pos]
    logits -= freq[:, None] * counts
    logits -= pres[:, None] * (counts > 0)
    return logits


@pytest.mark.parametrize("v", [50, BLOCK + 77])  # one partial block; a full one and a partial one
def test_fused_penalties_match_the_torch_form_and_vllm(device, v):
    g = torch.Generator().manual_seed(v)
    s, c = 5, 7
    logits = torch.randn(s, v, generator=g) * 3
    logits[torch.rand(s, v, generator=g) < 0.1] = float("-inf")
    counts = torch.randint(0, 3, (c, v), generator=g).float() * (torch.rand(c, v, generator=g) < 0.2)
    seen = (counts > 0) | (torch.rand(c, v, generator=g) < 0.1)
    rows, slots = torch.tensor([3, 0, 4]), torch.tensor([6, 2, 0])
    rep, freq, pres = (
        torch.tensor([1.3, 0.8, 1.0]),
        torch.tensor([0.7, -1.0, 0.0]),
        torch.tensor([-0.4, 2.0, 0.5]),
    )
    args = [t.to(device) for t in (rows, slots, counts, seen, rep, freq, pres)]
    got, want = logits.clone().to(device), logits.clone()
    apply_penalties(got, *args)
    penalties_torch(want, rows, slots, counts, seen, rep, freq, pres)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(want[rows], _vllm(logits[rows], counts[slots], seen[slots], rep, freq, pres))
    untouched = [1, 2]
    assert torch.equal(got.cpu()[untouched], logits[untouched])


def test_fused_penalties_check_their_inputs(device):
    idx = torch.zeros(1, dtype=torch.long, device=device)
    p = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="float32"):
        apply_penalties(torch.zeros(1, 8, dtype=torch.float16, device=device), idx, idx,
                        torch.zeros(1, 8, device=device), torch.zeros(1, 8, dtype=torch.bool, device=device),
                        p, p, p)  # fmt: skip
