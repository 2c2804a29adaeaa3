"""This rank's routed experts over what dispatch delivered (the middle of router -> dispatch -> experts ->
combine). Same SwiGLU math as the model's `Experts`, over the rank's S local slots.

Legend: S local slots, I moe_intermediate_size, D hidden, M received rows, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from libs.ep.dispatch.base import Dispatched


def expert_mlp(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert: gate_up [2I, D], down [D, I], x [n, D] -> [n, D]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def run_local_experts(gate_up: torch.Tensor, down: torch.Tensor, d: Dispatched) -> torch.Tensor:
    """gate_up [S, 2I, D], down [S, D, I] -> "tokens": [M, D] weighted sum over each row's local experts;
    "experts": [S, cap, D] per expert, rows past counts[e] left zero."""
    if d.layout == "experts":
        assert d.counts is not None
        out = torch.zeros_like(d.x)
        for e, n in enumerate(d.counts):
            if n:
                out[e, :n] = expert_mlp(gate_up[e], down[e], d.x[e, :n])
        return out
    assert d.local_ids is not None and d.weights is not None
    x, ids = d.x, d.local_ids
    row, kk = (ids >= 0).nonzero(as_tuple=True)  # one entry per (row, local expert)
    if row.numel() == 0:
        return torch.zeros_like(x)
    expert = ids[row, kk]
    order = expert.argsort(stable=True)
    row, kk, expert = row[order], kk[order], expert[order]
    counts = torch.bincount(expert, minlength=gate_up.shape[0]).tolist()
    xs = x[row]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(expert_mlp(gate_up[e], down[e], xs[start : start + n]))
            start += n
    y = torch.cat(outs) * d.weights[row, kk][:, None]
    return torch.zeros_like(x).index_add_(0, row, y.to(x.dtype))
