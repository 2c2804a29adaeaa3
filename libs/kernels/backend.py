"""Kernel backends chosen by device: the engine calls these; CUDA tensors go to the Triton kernels
(or FlashInfer's MLA where installed and asked for), CPU tensors to the plain-torch references.

The engine side calls, per layer of a decode step:
- `mla_decode_attention(q, kv_layer, page_table, seq_lens, page_size, sm_scale)` -> [B, H, 512]
- `mla_absorbed_decode(...)`: the hook `libs.engine.layers.mla.mla_absorbed` calls for decode batches
- `block_fp8_linear(x, w, w_scale_inv)` -> x @ dequant(w).T for FP8 checkpoints' weights
- `moe_route(logits, bias, ...)` -> (weights, ids)
"""

from __future__ import annotations

import torch

from libs.kernels import fp8_gemm, mla_decode, quant, routing


def page_table_tensor(page_tables: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """ForwardBatch's per-sequence page lists -> one [S, max_pages] int32 table (rows padded with 0)."""
    width = max((len(p) for p in page_tables), default=1)
    table = torch.zeros(len(page_tables), max(width, 1), dtype=torch.int32)
    for i, p in enumerate(page_tables):
        table[i, : len(p)] = p.to(torch.int32)
    return table.to(device)


def mla_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    kv_scale: float = 1.0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode, q [B, H, 576] -> [B, H, 512]; Triton on CUDA, torch reference elsewhere."""
    if q.is_cuda:
        if num_splits is None:
            cfg = mla_decode.MLAConfig()
            num_splits = mla_decode.choose_num_splits(
                q.shape[0], q.shape[1], int(page_table.shape[1]) * page_size, cfg
            )
        return mla_decode.mla_decode(
            q, kv_layer, page_table, seq_lens, page_size, sm_scale, num_splits=num_splits, kv_scale=kv_scale
        )
    return mla_decode.mla_decode_reference(q, kv_layer, page_table, seq_lens, page_size, sm_scale, kv_scale)


def mla_absorbed_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    layer_rows: torch.Tensor,
    kv_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """The engine's hook for absorbed decode (one query per sequence, in sequence order):
    q_latent [S, H, 512], q_pe [S, H, 64], layer_rows [slots, 576], kv_slots [S, K] (the pool slot of
    each key, used as a page table of page size 1), seq_lens [S] -> [S, H, 512], or None when this
    backend does not apply (CPU tensors, other MLA dims, head counts the kernel does not tile) and the
    caller should take its torch path."""
    s, h, r = q_latent.shape
    if not q_latent.is_cuda or r != mla_decode.LATENT_DIM or q_pe.shape[-1] != mla_decode.ROPE_DIM:
        return None
    if h % min(64, max(16, 1 << (h - 1).bit_length())):
        return None
    cfg = mla_decode.MLAConfig()
    splits = mla_decode.choose_num_splits(s, h, int(kv_slots.shape[1]), cfg)
    return mla_decode.mla_decode(
        q_latent, layer_rows, kv_slots.to(torch.int32), seq_lens.to(torch.int32), 1, scale,
        num_splits=splits, cfg=cfg, q_rope=q_pe.to(q_latent.dtype),
    )  # fmt: skip


def block_fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """y = x @ (w * block scales).T with DeepSeek's 128x128 `weight_scale_inv`; x [..., K] -> [..., N]."""
    if x.is_cuda:
        xq, xs = quant.quant_fp8_groups(x.reshape(-1, x.shape[-1]).contiguous())
        y = fp8_gemm.fp8_gemm(xq, xs, w, w_scale_inv, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], w.shape[0])
    return x @ fp8_gemm.dequant_blocks(w, w_scale_inv).to(x.dtype).T


def moe_route(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob=True):
    """DeepSeek-V3 noaux_tc routing -> (weights [T, K] f32, ids [T, K] int32)."""
    fn = routing.route if logits.is_cuda else routing.route_reference
    return fn(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob)
