"""Multi-head latent attention over the paged latent KV pool, in its two equivalent forms.

Legend: T new tokens, S sequences, Q most new tokens of one sequence, K longest KV length, H heads,
N qk_nope_head_dim, r qk_rope_head_dim, R kv_lora_rank, V v_head_dim, C = R + r (one cached row).

The cache holds one row per token: normalized c_kv [R] then roped k_pe [r]. With
W = kv_b_proj.weight viewed [H, N + V, R], split into W_UK [H, N, R] and W_UV [H, V, R]:
- expanded (prefill): k_nope = c_kv W_UK^T, v = c_kv W_UV^T per head; ordinary attention with
  k = [k_nope, k_pe] and q = [q_nope, q_pe] of width N + r.
- absorbed (decode): q_nope W_UK is moved to the query side, so every head attends straight over the
  cached rows: q' = [q_nope W_UK, q_pe] (width R + r = C) against k = the row itself, values = c_kv,
  then the [R] output per head goes through W_UV. Same scores and outputs, no per-token expansion.
Ragged batches are padded to [S, Q] queries and [S, K] keys; the mask lets query i of sequence s see
keys 0 .. prefix_len + i only (padded query rows repeat the last real query and are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from libs.engine.forward_batch import ForwardBatch


@dataclass
class AttentionMetadata:
    """Index tensors built once per forward and shared by every layer."""

    kv_slots: torch.Tensor  # [S, K] int64: pool slot of each key row (padding points at a real slot, masked)
    mask: torch.Tensor  # [S, 1, Q, K] bool: True where the query may attend
    q_index: torch.Tensor  # [S, Q] int64 into the T new tokens
    q_valid: torch.Tensor  # [S, Q] bool: real (not padding) queries

    @classmethod
    def from_batch(cls, batch: ForwardBatch, page_size: int, device: torch.device) -> AttentionMetadata:
        ext = torch.tensor(batch.extend_lens, dtype=torch.int64)
        prefix = torch.tensor(batch.prefix_lens(), dtype=torch.int64)
        k_max, q_max = max(batch.seq_lens), int(ext.max())
        pages_needed = -(-k_max // page_size)
        tables = torch.zeros(batch.num_seqs, pages_needed, dtype=torch.int64)
        for s, (table, seq_len) in enumerate(zip(batch.page_tables, batch.seq_lens, strict=True)):
            n = -(-seq_len // page_size)
            if table.numel() < n:
                raise ValueError(
                    f"sequence {s}: page table has {table.numel()} pages, {seq_len} tokens need {n}"
                )
            tables[s, :n] = table[:n].to(torch.int64).cpu()
        key_pos = torch.arange(k_max)
        kv_slots = tables[:, key_pos // page_size] * page_size + key_pos % page_size
        q_pos = torch.minimum(torch.arange(q_max)[None, :], (ext - 1)[:, None])  # [S, Q]
        starts = ext.cumsum(0) - ext
        mask = key_pos[None, None, :] <= (prefix[:, None] + q_pos)[:, :, None]
        return cls(
            kv_slots=kv_slots.to(device),
            mask=mask[:, None].to(device),
            q_index=(starts[:, None] + q_pos).to(device),
            q_valid=(torch.arange(q_max)[None, :] < ext[:, None]).to(device),
        )


def mla_expanded(
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, r] roped
    layer_rows: torch.Tensor,  # [P * page_size, C] this layer's pool, new rows already written
    kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """-> [T, H, V]"""
    h, n = q_nope.shape[1], q_nope.shape[2]
    r = q_pe.shape[2]
    rows = layer_rows[meta.kv_slots]  # [S, K, C]
    c_kv, k_pe = rows[..., :-r], rows[..., -r:]
    s, k_len = rows.shape[0], rows.shape[1]
    kv = F.linear(c_kv.to(kv_b_weight.dtype), kv_b_weight).view(s, k_len, h, -1).transpose(1, 2)
    k_nope, v = kv[..., :n], kv[..., n:]  # [S, H, K, N], [S, H, K, V]
    k = torch.cat([k_nope, k_pe.to(k_nope.dtype)[:, None].expand(s, h, k_len, r)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)[meta.q_index].transpose(1, 2)  # [S, H, Q, N + r]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask, scale=scale)  # [S, H, Q, V]
    return out.transpose(1, 2)[meta.q_valid]


def mla_absorbed(
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, r] roped
    layer_rows: torch.Tensor,  # [P * page_size, C]
    kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """-> [T, H, V]"""
    h, n = q_nope.shape[1], q_nope.shape[2]
    r = q_pe.shape[2]
    w = kv_b_weight.view(h, -1, kv_b_weight.shape[1])  # [H, N + V, R]
    w_uk, w_uv = w[:, :n], w[:, n:]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
    if q_nope.is_cuda and meta.q_index.shape[1] == 1:  # decode on a GPU: paged Triton kernel (libs.kernels)
        from libs.kernels.backend import mla_absorbed_decode

        seq_lens = meta.mask[:, 0, 0].sum(-1)
        fast = mla_absorbed_decode(q_latent, q_pe, layer_rows, meta.kv_slots, seq_lens, scale)  # [S=T, H, R]
        if fast is not None:
            return torch.einsum("thr,hvr->thv", fast, w_uv)
    q = torch.cat([q_latent, q_pe], dim=-1)[meta.q_index]  # [S, Q, H, C]
    s, q_len = q.shape[0], q.shape[1]
    rows = layer_rows[meta.kv_slots].to(q.dtype)[:, None]  # [S, 1, K, C]
    # every head reads the same rows: fold heads into the query axis (one-head attention, [S, 1, Q*H, C])
    mask = meta.mask.repeat_interleave(h, dim=2)  # [S, 1, Q*H, K], row q*H + h is query q's mask
    out_latent = F.scaled_dot_product_attention(
        q.reshape(s, 1, q_len * h, -1), rows, rows[..., :-r], attn_mask=mask, scale=scale
    ).view(s, q_len, h, -1)  # [S, Q, H, R]
    out = torch.einsum("sqhr,hvr->sqhv", out_latent, w_uv)  # [S, Q, H, V]
    return out[meta.q_valid]
