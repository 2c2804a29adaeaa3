"""Kernel backends chosen by device, called by the engine's FP8 modules (libs.engine.layers.fp8_linear):
`moe_route`, `fp8_linear`, `fp8_swiglu_mlp`, `fp8_moe`. CUDA tensors go to the Triton kernels, CPU tensors to
the plain-torch references of the same math. Attention goes through libs.engine.layers.attention_backend."""

from __future__ import annotations

import torch

from libs.kernels import fp8_gemm, moe_ops, quant, routing
from libs.kernels.fp8_gemm import triton_usable
from libs.quant.fp8 import dequantize_fp8_groups, quantize_fp8_groups


def moe_route(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob=True):
    """DeepSeek-V3 noaux_tc routing -> (weights [T, K] f32, ids [T, K] int32)."""
    fn = routing.route if logits.is_cuda else routing.route_reference
    return fn(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob)


# --- FP8 block-scaled weights in the engine (libs.engine.layers.fp8_linear calls these) ---
# Every function below runs DeepSeek's FP8 inference math: activations quantized 1x128 on the fly, weights
# kept float8 with 128x128 `weight_scale_inv` blocks, fp32 accumulation, outputs in the activation dtype.
# Triton where `triton_usable` (CUDA, or CPU under Triton's interpreter in tests); otherwise the torch
# reference of the same math, so an FP8 model gives the same numbers (to rounding) on every device.


def _quant(x2d: torch.Tensor, kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if kernels:
        return quant.quant_fp8_groups(x2d.contiguous())
    return quantize_fp8_groups(x2d)


def _gemm(xq, xs, w, w_s, dtype: torch.dtype, kernels: bool) -> torch.Tensor:
    if kernels:
        return fp8_gemm.fp8_gemm(xq, xs, w, w_s, out_dtype=dtype)
    return fp8_gemm.fp8_gemm_reference(xq, xs, w, w_s, out_dtype=dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: quantize x 1x128, multiply by the FP8 weight w [N, K] with
    its scales w_s [ceil(N/128), K/128]. K must be a multiple of 128."""
    k = x.shape[-1]
    kernels = triton_usable(x)
    xq, xs = _quant(x.reshape(-1, k), kernels)
    y = _gemm(xq, xs, w, w_s, x.dtype, kernels)
    return y.view(*x.shape[:-1], w.shape[0])


def fp8_swiglu_mlp(x: torch.Tensor, gate_up: tuple, down: tuple) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with FP8 weights: gate_up = (w [2I, D] gate rows then up rows, scales
    [2I/128, D/128]), down = (w [D, I], scales); one GEMM for gate and up, SwiGLU fused with the quantization
    of the down projection's input. x [T, D] -> [T, D] in x.dtype."""
    kernels = triton_usable(x)
    xq, xs = _quant(x, kernels)
    h = _gemm(xq, xs, gate_up[0], gate_up[1], x.dtype, kernels)  # [T, 2I]
    if kernels:
        hq, hs = quant.silu_mul_quant(h)
    else:
        hq, hs = quantize_fp8_groups(quant.silu_mul_reference(h))
    return _gemm(hq, hs, down[0], down[1], x.dtype, kernels)


def fp8_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: tuple, w2: tuple,
    add: torch.Tensor | None = None, *, masked: bool, block_m: int = 128, m_max: int | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None, all_local: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Routed experts with FP8 weights: x [T, D], ids [T, K] (-1: none; distinct per token), weights [T, K] f32,
    w13 = (gate_up [E, 2I, D], scales), w2 = (down [E, D, I], scales) -> [T, D] = sum_k weights * expert(x)
    (+ add). masked=True: the graph-safe decode layout; False: contiguous by expert (prefill). all_local: no id
    is -1, so the contiguous layout is sized from the shapes (no host sync); else one sync reads its size.
    block_m: the contiguous layout's row tile (each expert's run padded to it; 128 timed faster than 64 for
    prefill's rows, bench/NOTES-decode.md)."""
    # masked buffers are [E, m_max, D], fixed by the shapes: m_max defaults to T (an expert gets at most one
    # row per token); an emulated EP rank whose picks repeat a local expert needs T * K. quantized: x as 1x128
    # FP8 rows + scales already (what an EP dispatch received), copied into the expert buffers as they are.
    if x.shape[0] == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if not triton_usable(x):
        return fp8_moe_reference(x, ids, weights, w13, w2, add)
    if masked and quantized is not None:
        out, dest = _moe_masked_quantized(*quantized, ids.reshape(-1), w13, w2, m_max or x.shape[0], x.dtype)
    elif masked:
        out, dest = _moe_masked(x.contiguous(), ids.reshape(-1), w13, w2, m_max or x.shape[0])
    else:
        out, dest = _moe_contiguous(x.contiguous(), ids.reshape(-1), w13, w2, block_m, all_local)
    return moe_ops.combine_fused(out, dest, weights.float().contiguous(), add=add)


def _moe_masked(x, pair_ids, w13, w2, m_max):
    e, _, d = w13[0].shape
    dest, counts = moe_ops.align_masked(pair_ids, e, m_max)
    xq = torch.empty(e, m_max, d, dtype=fp8_gemm.FP8, device=x.device)
    xs = torch.empty(e, m_max, d // fp8_gemm.GROUP, dtype=torch.float32, device=x.device)
    moe_ops.dispatch_quant(x, dest, xq, xs)
    return moe_ops.moe_masked(xq, xs, counts, *w13, *w2, out_dtype=x.dtype), dest


def _moe_masked_quantized(xq, xs, pair_ids, w13, w2, m_max, out_dtype):
    """_moe_masked over rows quantized already: each pair's FP8 row and scales copied (as bytes, graph-safe:
    pairs without a row land on a scratch row past the buffers) to its expert row."""
    e, _, d = w13[0].shape
    dest, counts = moe_ops.align_masked(pair_ids, e, m_max)
    rows = torch.where(dest >= 0, dest, e * m_max)
    token = torch.arange(pair_ids.numel(), device=xq.device) // (pair_ids.numel() // xq.shape[0])
    bq = torch.empty(e * m_max + 1, d, dtype=torch.uint8, device=xq.device)
    bs = torch.empty(e * m_max + 1, xs.shape[1], dtype=torch.float32, device=xq.device)
    bq.index_copy_(0, rows, xq.contiguous().view(torch.uint8)[token])
    bs.index_copy_(0, rows, xs.contiguous()[token])
    q3 = bq[:-1].view(fp8_gemm.FP8).view(e, m_max, d)
    out = moe_ops.moe_masked(q3, bs[:-1].view(e, m_max, -1), counts, *w13, *w2, out_dtype=out_dtype)
    return out, dest


def _moe_contiguous(x, pair_ids, w13, w2, block_m, all_local):
    """all_local: every pair has a row, so a size for any routing wastes at most a tile per expert (an EP
    rank's received pairs are mostly -1: there the size is read back, one host sync)."""
    e, t = w13[0].shape[0], x.shape[0]
    k = pair_ids.numel() // t
    tiles = moe_ops.contiguous_tiles(pair_ids.numel(), e, block_m) if all_local else None
    order, tile_expert = moe_ops.align_contiguous(pair_ids, e, block_m, tiles)
    if order.numel() == 0:
        return x.new_zeros(1, x.shape[1]), torch.full_like(pair_ids, -1, dtype=torch.long)
    valid = order >= 0
    rows = torch.arange(order.numel(), device=x.device)
    dest = torch.full((pair_ids.numel() + 1,), -1, dtype=torch.long, device=x.device)
    dest.scatter_(0, torch.where(valid, order, pair_ids.numel()), rows)  # padding rows land on the spare slot
    dest = dest[:-1]
    xq, xs = quant.quant_fp8_groups(x)  # each token once, then gathered into its K expert rows
    token = torch.where(valid, order // k, 0)
    rq = xq.view(torch.uint8)[token].view(fp8_gemm.FP8)
    out = moe_ops.moe_contiguous(rq, xs[token], order, tile_expert, block_m, *w13, *w2, out_dtype=x.dtype)
    return out, dest


def fp8_moe_reference(x, ids, weights, w13, w2, add=None) -> torch.Tensor:
    """fp8_moe in plain torch, expert by expert: the same quantization steps, rounded to x.dtype where the
    kernels store (each GEMM's output), summed in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xd = dequantize_fp8_groups(*quantize_fp8_groups(x))  # [T, D] f32
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = (xd[tok] @ fp8_gemm.dequant_blocks(w13[0][e], w13[1][e]).T).to(x.dtype)
        h = dequantize_fp8_groups(*quantize_fp8_groups(quant.silu_mul_reference(gate_up)))
        y = (h @ fp8_gemm.dequant_blocks(w2[0][e], w2[1][e]).T).to(x.dtype)
        out.index_add_(0, tok, y.float() * weights[tok, slot, None].float())
    if add is not None:
        out += add.float()
    return out.to(x.dtype)
