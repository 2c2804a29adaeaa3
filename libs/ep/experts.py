"""This rank's routed experts over what dispatch delivered (router -> dispatch -> experts -> combine), the
model's SwiGLU over its S local slots: dense weights expert by expert (`run_local_experts`, the CPU
reference), FP8 weights through the single-rank engine's grouped GEMMs (`run_fp8_experts`)."""

# Legend: S local slots, I moe_intermediate_size, D hidden, M received rows, K experts per token.

from __future__ import annotations

import torch
import torch.nn.functional as F

from libs.ep.dispatch.base import Dispatched


def count_load(load: torch.Tensor, ids: torch.Tensor) -> None:
    """load [E] += tokens per logical expert in ids [T, K] (a scatter-add: no host sync, graph-safe)."""
    flat = ids.flatten().long()
    load.scatter_add_(0, flat, torch.ones_like(flat, dtype=load.dtype))


def run_fp8_experts(experts, d: Dispatched, rows_per_expert: int | None = None) -> torch.Tensor:
    """The model's FP8 stacked experts over a round: "tokens" -> [M, D] weighted sum per row (ids -1 skipped);
    "experts" -> [S, cap, D] unweighted, rows past counts zero. rows_per_expert: the masked layout's rows per
    expert (default M). Masked (graph-safe) or contiguous GEMM: fp8_linear.use_masked_moe decides."""
    from libs.engine.layers.fp8_linear import use_masked_moe
    from libs.kernels.backend import fp8_moe

    w13 = (experts.gate_up_proj, experts.gate_up_proj_scale_inv)
    w2 = (experts.down_proj, experts.down_proj_scale_inv)
    s = w13[0].shape[0]
    if d.layout == "experts":  # each row once, to its own expert, weight 1: the tokens path over [S*cap] rows
        assert d.counts is not None
        cap = d.x.shape[1]
        rows = torch.arange(cap, device=d.x.device)[None, :]
        counts = torch.as_tensor(d.counts, device=d.x.device)[:, None]
        expert = torch.arange(s, device=d.x.device)[:, None].expand(s, cap)
        ids = torch.where(rows < counts, expert, -1).reshape(-1, 1)
        x = d.x.reshape(s * cap, -1)
        masked = use_masked_moe(x.shape[0], 1, s)
        y = fp8_moe(x, ids, torch.ones(ids.shape, device=x.device), w13, w2, masked=masked)
        return y.view_as(d.x)
    assert d.local_ids is not None and d.weights is not None
    masked = use_masked_moe(d.x.shape[0], d.local_ids.shape[1], s)
    return fp8_moe(
        d.x, d.local_ids, d.weights, w13, w2, masked=masked, m_max=rows_per_expert, quantized=d.quantized
    )


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
