"""Optional MLA backends from FlashInfer (not a dependency: `available()` says whether it imports): decode with
BatchMLAPagedAttentionWrapper, prefill with BatchPrefillWithRaggedKVCacheWrapper. `plan` runs once per batch
composition (host work, outside CUDA graphs), `run` once per layer."""

# The latent pool's rows [slots, 576] are viewed as FlashInfer's two caches ([pages, page_size, 512] and
# [.., 64]) without a copy; FP8 rows of the "tensor" layout (uint8 [slots, 576], libs/engine/kv_fp8.py) the
# same way as float8_e4m3fn, with their one scale for both caches (its SM90 path dequantizes in shared memory).

from __future__ import annotations

import numpy as np
import torch


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # any import failure (missing package, missing CUDA libraries) means "not here"
        return False
    return True


class FlashInferMLA:
    """graph_batch: a wrapper for CUDA graphs of that batch size (its index buffers fixed, re-planned on the
    host before each replay with `plan_host`); workspace: share another wrapper's float workspace (graphs of
    different sizes replay one at a time)."""

    def __init__(self, device: torch.device | str, backend: str = "fa3", workspace_mb: int = 256, *,
                 workspace: torch.Tensor | None = None, graph_batch: int | None = None,
                 max_pages: int = 0) -> None:  # fmt: skip
        import flashinfer

        self._ws = workspace if workspace is not None else torch.empty(workspace_mb << 20, dtype=torch.uint8, device=device)
        bufs = {}
        if graph_batch is not None:
            b = graph_batch
            bufs = dict(
                use_cuda_graph=True, qo_indptr=torch.arange(b + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.zeros(b + 1, dtype=torch.int32, device=device),
                kv_indices=torch.zeros(b * max_pages, dtype=torch.int32, device=device),
                kv_len_arr=torch.zeros(b, dtype=torch.int32, device=device),
            )  # fmt: skip
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._ws, backend=backend, **bufs)
        self._page_size = 0

    @property
    def workspace(self) -> torch.Tensor:
        return self._ws

    def plan_host(self, seq_lens: np.ndarray, page_table: np.ndarray, page_size: int, num_heads: int,
                  sm_scale: float, dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """plan() from host arrays (seq_lens [B], page_table [B, P]): no device work but the index copies.
        kv_dtype: the rows' (float8_e4m3fn for FP8 rows; default `dtype`)."""
        b = seq_lens.shape[0]
        pages = (seq_lens.astype(np.int64) + page_size - 1) // page_size
        kv_indptr = np.zeros(b + 1, dtype=np.int32)
        kv_indptr[1:] = np.cumsum(pages)
        width = int(pages.max()) if b else 0  # the columns in use, not the table's whole context width
        kv_indices = page_table[:, :width][np.arange(width)[None, :] < pages[:, None]].astype(np.int32)
        self._page_size = page_size
        self._wrapper.plan(
            torch.arange(b + 1, dtype=torch.int32), torch.from_numpy(kv_indptr), torch.from_numpy(kv_indices),
            torch.from_numpy(seq_lens.astype(np.int32)), num_heads, 512, 64, page_size, False, sm_scale, dtype,
            kv_dtype or dtype,
        )  # fmt: skip

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_heads: int,
             sm_scale: float, dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """page_table [B, max_pages] int32, seq_lens [B] int32 (device tensors); kv_dtype as plan_host's."""
        b = seq_lens.shape[0]
        dev = seq_lens.device
        pages = (seq_lens + page_size - 1) // page_size
        kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        cols = torch.arange(page_table.shape[1], device=dev)
        kv_indices = page_table[cols[None, :] < pages[:, None]].to(torch.int32)
        qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self._page_size = page_size
        self._wrapper.plan(qo_indptr, kv_indptr, kv_indices, seq_lens.to(torch.int32), num_heads, 512, 64,
                           page_size, False, sm_scale, dtype, kv_dtype or dtype)  # fmt: skip

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
            out: torch.Tensor | None = None, kv_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
        """q_nope [B, H, 512] and q_pe [B, H, 64] (batch/head strides free), kv_layer [slots, 576] (16-bit rows,
        or FP8 rows of the "tensor" layout as uint8 with their scale, planned with kv_dtype float8_e4m3fn)
        -> [B, H, 512]."""
        if kv_layer.dtype == torch.uint8:
            paged = kv_layer.view(torch.float8_e4m3fn).view(-1, self._page_size, kv_layer.shape[-1])
            return self._wrapper.run(q_nope, q_pe, paged[..., :512], paged[..., 512:], out=out,
                                     ckv_scale=kv_scale, kpe_scale=kv_scale)  # fmt: skip
        paged = kv_layer.view(-1, self._page_size, kv_layer.shape[-1])
        return self._wrapper.run(q_nope, q_pe, paged[..., :512], paged[..., 512:], out=out)


RAGGED_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})  # (qk, vo) its prefill kernels take


def ragged_prefill_fits(head_dim_qk: int, head_dim_vo: int) -> bool:
    """FlashInfer's ragged prefill compiles for these head-dim pairs only (DeepSeek-V3's 192/128 among them);
    others (the tests' tiny 96/32) fail in the kernel ("Invalid configuration"), so callers take SDPA."""
    return (head_dim_qk, head_dim_vo) in RAGGED_HEAD_DIMS


class FlashInferRaggedPrefill:
    """Causal attention over ragged chunks whose keys include a cached prefix (FlashInfer aligns the
    causal mask bottom-right: query i of a chunk sees keys 0 .. kv_len - q_len + i). Keys/values are the
    expanded MLA heads: qk dim N + r (192 for DeepSeek-V3), v dim V (128), as SGLang's MLA prefill."""

    def __init__(self, device: torch.device | str, workspace_mb: int = 256) -> None:
        import flashinfer

        self._ws = torch.empty(workspace_mb << 20, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._ws, "NHD")
        self._planned: tuple | None = None

    def plan(self, q_lens: list[int], kv_lens: list[int], num_heads: int, sm_scale: float,
             dtype: torch.dtype, head_dim_qk: int = 192, head_dim_vo: int = 128) -> None:  # fmt: skip
        """Host lists of new tokens and KV length per sequence (kv_len >= q_len)."""
        qo = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv = torch.tensor([0, *kv_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self._planned = (head_dim_qk, head_dim_vo)
        self._wrapper.plan(qo, kv, num_heads, num_heads, head_dim_qk, head_dim_vo=head_dim_vo, causal=True,
                           sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype)  # fmt: skip

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, Dqk], k [sum K, H, Dqk], v [sum K, H, Dvo] -> [T, H, Dvo]."""
        if self._planned is None or (q.shape[-1], v.shape[-1]) != self._planned:
            raise ValueError(f"plan() for head dims {(q.shape[-1], v.shape[-1])} must come before run()")
        return self._wrapper.run(q, k, v)
