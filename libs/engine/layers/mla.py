"""Multi-head latent attention over the paged latent KV pool, in its two equivalent forms: expanded (prefill:
per-head k_nope and v from c_kv) and absorbed (decode: W_UK moved to the query side, every head attending
straight over the cached rows), over `AttentionMetadata` (plain-torch reference) or `PagedMetadata` (kernels)."""

# Legend: T new tokens, S sequences, Q most new tokens of one sequence, K longest KV length, H heads,
# N qk_nope_head_dim, r qk_rope_head_dim, R kv_lora_rank, V v_head_dim, C = R + r (one cached row).
# A cached row is normalized c_kv [R] then roped k_pe [r]; W = kv_b_proj.weight viewed [H, N + V, R] splits
# into W_UK [H, N, R] and W_UV [H, V, R]. Expanded: k_nope = c_kv W_UK^T, v = c_kv W_UV^T, attention over
# width N + r. Absorbed: q' = [q_nope W_UK, q_pe] (width C) against the rows themselves, values c_kv, the [R]
# output per head through W_UV: same scores, no per-token expansion.
# AttentionMetadata pads ragged batches to [S, Q] queries and [S, K] keys with a host-built mask (query i
# sees keys 0 .. prefix_len + i; padded rows repeat the last query and are dropped): O(S * Q * K).
# PagedMetadata is the pool's real pages as an [S, P] table plus KV lengths on the device: nothing grows with
# Q * K, and decode reads nothing from the host.
# An FP8 pool's layer is raw row bytes (libs/engine/kv_fp8.py): every form here dequantizes what it gathers.

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from libs.engine.forward_batch import ForwardBatch
from libs.engine.kv_fp8 import read_rows


def padded_page_table(batch: ForwardBatch, page_size: int) -> torch.Tensor:
    """[S, P] int64 on the host: each sequence's first ceil(seq_len / page_size) pages, 0-padded to the
    longest. Real pool pages, never a per-key expansion."""
    need = [-(-n // page_size) for n in batch.seq_lens]
    tables = torch.zeros(batch.num_seqs, max(need), dtype=torch.int64)
    for s, (table, n) in enumerate(zip(batch.page_tables, need, strict=True)):
        if table.numel() < n:
            raise ValueError(
                f"sequence {s}: page table has {table.numel()} pages, {batch.seq_lens[s]} tokens need {n}"
            )
        tables[s, :n] = table[:n].to(torch.int64).cpu()
    return tables


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
        tables = padded_page_table(batch, page_size)
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
    layer_rows: torch.Tensor,  # [P * page_size, C] this layer's pool (or its FP8 row bytes), new rows written
    kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """-> [T, H, V]"""
    h, n = q_nope.shape[1], q_nope.shape[2]
    r = q_pe.shape[2]
    rows = read_rows(layer_rows[meta.kv_slots], kv_b_weight.shape[1], r, kv_b_weight.dtype)  # [S, K, C]
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
    q = torch.cat([q_latent, q_pe], dim=-1)[meta.q_index]  # [S, Q, H, C]
    s, q_len = q.shape[0], q.shape[1]
    rows = read_rows(layer_rows[meta.kv_slots], w.shape[2], r, q.dtype).to(q.dtype)[:, None]  # [S, 1, K, C]
    # every head reads the same rows: fold heads into the query axis (one-head attention, [S, 1, Q*H, C])
    mask = meta.mask.repeat_interleave(h, dim=2)  # [S, 1, Q*H, K], row q*H + h is query q's mask
    out_latent = F.scaled_dot_product_attention(
        q.reshape(s, 1, q_len * h, -1), rows, rows[..., :-r], attn_mask=mask, scale=scale
    ).view(s, q_len, h, -1)  # [S, Q, H, R]
    out = torch.einsum("sqhr,hvr->sqhv", out_latent, w_uv)  # [S, Q, H, V]
    return out[meta.q_valid]


@dataclass
class PagedMetadata:
    """The batch's keys as the paged kernels read them: device tensors plus the host facts they need. A decode
    CUDA graph holds one with static tensors; `num_splits` depends on batch size and table width only, so the
    graph stays valid as sequences grow. `extend_lens`/`kv_lens` (host) serve the eager prefill path only."""

    page_table: torch.Tensor  # [S, P] int32 pool page ids in order; entries past a sequence's end are 0
    seq_lens: torch.Tensor  # [S] int32 KV length of each sequence after this forward (>= 1)
    page_size: int
    num_splits: int = 1  # Triton decode: split-K programs per sequence
    extend_lens: list[int] | None = None  # [S] new tokens per sequence (host)
    kv_lens: list[int] | None = None  # [S] host copy of seq_lens
    part: int | None = None  # two-batch overlap: these are micro-batch 0's or 1's rows (backends planned per part)


def gather_pages(layer_rows: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """layer_rows [P * page_size, C], pages [..., n] -> [..., n * page_size, C] rows in token order."""
    paged = layer_rows.view(-1, page_size, layer_rows.shape[-1])[pages.long()]  # [..., n, page, C]
    return paged.flatten(-3, -2)


def mla_decode_paged(
    q_latent: torch.Tensor,  # [S, H, R] = q_nope W_UK, one query per sequence
    q_pe: torch.Tensor,  # [S, H, r] roped
    layer_rows: torch.Tensor,  # [P * page_size, C]
    meta: PagedMetadata,
    scale: float,
) -> torch.Tensor:
    """Absorbed decode in plain torch over the paged metadata -> [S, H, R] latent outputs; CUDA-graph safe
    (reads every row the table could address, masked by seq_lens: shapes depend on the table width only).
    The Triton kernel replaces it where its dims fit."""
    r = q_pe.shape[-1]
    s, h = q_latent.shape[0], q_latent.shape[1]
    rows = gather_pages(layer_rows, meta.page_table, meta.page_size)
    rows = read_rows(rows, q_latent.shape[-1], r, q_latent.dtype).to(q_latent.dtype)  # [S, K, C]
    rows = rows[:, None]  # [S, 1, K, C]: one "head" of keys shared by every query head
    valid = torch.arange(rows.shape[2], device=rows.device) < meta.seq_lens[:, None]  # [S, K]
    q = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)[:, None]  # [S, 1, H, C]: heads as queries
    out = F.scaled_dot_product_attention(q, rows, rows[..., :-r], attn_mask=valid[:, None, None], scale=scale)
    return out.view(s, h, -1)


def preload_extend_sdpa() -> None:
    """Import what mla_extend_sdpa needs (torch._dynamo and sympy: ~1.5 s of CPU holding the GIL) now, at
    start-up, rather than in a worker's first prefill, where it stalls the event loop past its heartbeats."""
    import torch.nn.attention.bias  # noqa: F401


def joined_query(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """The expanded query [T, H, N + r]: a view when q_pe continues q_nope inside one tensor (the fused path
    rotates q's rope part in place), else their concatenation."""
    n, width = q_nope.shape[-1], q_nope.shape[-1] + q_pe.shape[-1]
    adjacent = (
        q_nope.stride(-1) == 1 and q_pe.stride() == q_nope.stride() and q_pe.shape[:-1] == q_nope.shape[:-1]
        and q_pe.dtype == q_nope.dtype and q_pe.data_ptr() == q_nope.data_ptr() + n * q_nope.element_size()
        and all(st >= width for st in q_nope.stride()[:-1])
    )  # fmt: skip
    if adjacent:
        return q_nope.as_strided((*q_nope.shape[:-1], width), q_nope.stride())
    return torch.cat([q_nope, q_pe], dim=-1)


def expanded_keys(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The expanded prefill's keys [K, H, N + r]: each head's no-RoPE part k_nope [K, H, N] (a view of the kv_b
    projection's output) beside the RoPE part k_pe [K, r] every head shares, in k_nope's dtype. On CUDA one
    Triton copy (libs/kernels/mla_prefill.concat_k), elsewhere torch.cat."""
    if k_nope.is_cuda:
        from libs.kernels import mla_prefill

        if mla_prefill.fits(k_nope.shape[-1], k_pe.shape[-1]):
            return mla_prefill.concat_k(k_nope, k_pe)
    return torch.cat([k_nope, k_pe[:, None].to(k_nope.dtype).expand(-1, k_nope.shape[1], -1)], dim=-1)


def mla_extend_sdpa(
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, r] roped
    layer_rows: torch.Tensor,  # [P * page_size, C] this layer's pool, new rows already written
    kv_b_weight: torch.Tensor,  # [H * (N + V), R] dense
    meta: PagedMetadata,
    scale: float,
) -> torch.Tensor:
    """Expanded MLA for ragged chunks with cached prefixes -> [T, H, V], one SDPA call per sequence: query i
    of a chunk sees keys 0 .. prefix + i (SDPA's lower-right causal bias). Memory is per sequence (its K
    expanded keys), never [S, Q, K] across the batch."""
    if meta.extend_lens is None or meta.kv_lens is None:
        raise ValueError("mla_extend_sdpa needs the host extend_lens and kv_lens in the metadata")
    from torch.nn.attention.bias import causal_lower_right  # loaded by preload_extend_sdpa()

    t, h, n = q_nope.shape
    r = q_pe.shape[-1]
    q = joined_query(q_nope, q_pe)  # [T, H, N + r]
    out = q_nope.new_empty(t, h, kv_b_weight.shape[0] // h - n)
    start = 0
    for s, (q_len, k_len) in enumerate(zip(meta.extend_lens, meta.kv_lens, strict=True)):
        pages = meta.page_table[s, : -(-k_len // meta.page_size)]
        rows = gather_pages(layer_rows, pages, meta.page_size)[:k_len]
        rows = read_rows(rows, kv_b_weight.shape[1], r, kv_b_weight.dtype)  # [K, C]
        kv = F.linear(rows[:, :-r].to(kv_b_weight.dtype), kv_b_weight).view(k_len, h, -1)  # [K, H, N + V]
        k = expanded_keys(kv[..., :n], rows[:, -r:])  # [K, H, N + r]
        # 4-D [1, H, len, dim]: the fused SDPA kernels (and so the mask-free lower-right bias) need a batch dim
        q_s = q[start : start + q_len].transpose(0, 1)[None]
        k_s, v_s = k.transpose(0, 1)[None], kv[..., n:].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q_s, k_s, v_s, attn_mask=causal_lower_right(q_len, k_len), scale=scale
        )
        out[start : start + q_len] = o[0].transpose(0, 1)  # [Q, H, V]
        start += q_len
    return out
