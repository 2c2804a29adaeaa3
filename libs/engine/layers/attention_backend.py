"""MLA attention backends over the paged latent pool, chosen by name ("torch", "triton", "flashinfer"; "auto":
FlashInfer on CUDA where it imports, else Triton; torch elsewhere). The model calls `prepare(batch, page_size,
absorbed)` once per forward, then `attend(...)` in every layer after writing its new latent rows."""

# Legend: T new tokens, S sequences, H heads, N nope dim, r rope dim, R kv_lora_rank, V v dim.
# The CUDA-graph runner builds the same `StepInputs` from its static buffers instead of `prepare`, for
# `graph_safe` backends only. "torch": the plain reference CPU runs and tests compare with (its [S, K] key
# index is built on the host: not graph-safe). "triton": `PagedMetadata` (page table + lengths, one copy per
# forward), decode with libs.kernels.mla_decode where its dims fit (R 512, r 64, heads in multiples of 16),
# `mla_decode_paged` otherwise, extend as one SDPA per sequence. "flashinfer": as triton, with FlashInfer's MLA
# decode and ragged prefill; it plans on the host, in `prepare` for eager forwards and in `plan_graph` before
# each replay (one wrapper per batch size); under two-batch overlap one wrapper per micro-batch
# (`plan_micro_batches`, `plan_graph`); extend forwards are not split (`splits_extend`).
# A backend is made for one KV row format (`kv_cache_dtype`). Over FP8 rows (libs/engine/kv_fp8.py) the paged
# backends decode with the kernel of the rows' layout where its dims fit, which `fp8_scales` picks for the
# pool: FlashInfer's decode over "tensor" rows (its SM90 FP8 path; backend "flashinfer" named), else over
# "token" rows libs.kernels.mla_decode_fp8_sm90 (Hopper, 64-row pages, heads in 64s) or libs.kernels.mla_decode_fp8;
# every other path reads the rows dequantized (FlashInfer's ragged prefill included).

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from libs.engine.config import ModelConfig
from libs.engine.forward_batch import ForwardBatch
from libs.engine.kv_fp8 import TENSOR_SCALE, fp8_rows, is_fp8, read_rows
from libs.engine.layers.mla import (
    AttentionMetadata,
    PagedMetadata,
    expanded_keys,
    joined_query,
    mla_absorbed,
    mla_decode_paged,
    mla_expanded,
    mla_extend_sdpa,
    padded_page_table,
    preload_extend_sdpa,
)

BACKENDS = ("auto", "torch", "triton", "flashinfer")


@dataclass
class MLAWeights:
    """kv_b_proj as the attention paths use it, made once per weight version (not per step)."""

    dense: torch.Tensor  # [H * (N + V), R]: expanded form (and the reference paths)
    w_uk: torch.Tensor  # [H, N, R] view: q_nope -> latent query
    w_uv: torch.Tensor  # [H, V, R] view: latent output -> v

    @classmethod
    def from_dense(cls, dense: torch.Tensor, num_heads: int, nope_dim: int) -> MLAWeights:
        w = dense.view(num_heads, -1, dense.shape[1])  # [H, N + V, R]
        return cls(dense, w[:, :nope_dim], w[:, nope_dim:])


@dataclass
class StepInputs:
    """What every layer of one forward reads: token inputs and attention metadata, on the device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] int64: pool slot receiving each new token's latent row
    meta: AttentionMetadata | PagedMetadata
    backend: AttentionBackend
    absorbed: bool  # decode form (one query per sequence, attention in latent space)


class AttentionBackend(ABC):
    name = ""
    graph_safe = False  # decode (prepare aside) can be captured in a CUDA graph

    def __init__(self, cfg: ModelConfig, device: torch.device, kv_cache_dtype: str = "auto") -> None:
        self.num_heads, self.scale, self.device = cfg.num_attention_heads, cfg.softmax_scale, device
        fp8_rows(kv_cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)  # a valid setting for this row shape
        self.kv_cache_dtype = kv_cache_dtype

    @abstractmethod
    def prepare(self, batch: ForwardBatch, page_size: int, absorbed: bool) -> StepInputs: ...

    @abstractmethod
    def attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_rows: torch.Tensor, weights: MLAWeights,
        step: StepInputs,
    ) -> torch.Tensor:  # fmt: skip
        """q_nope [T, H, N], q_pe [T, H, r] roped, layer_rows [P * page_size, C] -> [T, H, V]."""


class TorchAttention(AttentionBackend):
    """The reference: host-built [S, K] key index and dense masks (see layers/mla.py)."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, page_size: int, absorbed: bool) -> StepInputs:
        meta = AttentionMetadata.from_batch(batch, page_size, self.device)
        ids, pos, slots = (t.to(self.device) for t in (batch.input_ids, batch.positions, batch.out_slots))
        return StepInputs(ids, pos, slots.long(), meta, self, absorbed)

    def attend(self, q_nope, q_pe, layer_rows, weights, step):
        assert isinstance(step.meta, AttentionMetadata)
        fn = mla_absorbed if step.absorbed else mla_expanded
        return fn(q_nope, q_pe, layer_rows, weights.dense, step.meta, self.scale)


def pack_batch(batch: ForwardBatch, page_size: int) -> tuple[torch.Tensor, int]:
    """One int64 host tensor [ids T | positions T | out_slots T | seq_lens S | page table S * P] and P
    (the table is `padded_page_table`)."""
    table = padded_page_table(batch, page_size)  # [S, P]
    lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
    parts = [batch.input_ids, batch.positions, batch.out_slots, lens, table.flatten()]
    return torch.cat([p.to(torch.int64).cpu() for p in parts]), table.shape[1]


class TritonAttention(AttentionBackend):
    """Paged metadata on the device; Triton MLA decode where it fits, per-sequence SDPA for extend."""

    name = "triton"
    graph_safe = True

    def __init__(
        self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, use_kernel: bool | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:  # fmt: skip
        """use_kernel None: the Triton kernel (the FP8 one over FP8 rows) on CUDA when the dims fit and the model
        is 16-bit. True runs it whenever the dims fit, CPU tensors included, which needs Triton's interpreter
        (TRITON_INTERPRET=1, set before triton is imported: tests)."""
        super().__init__(cfg, device, kv_cache_dtype)
        preload_extend_sdpa()  # extend() needs it; loaded here, before the worker takes requests
        fits = _kernel_fits(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        auto = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        self.kernel_cfg = None
        if fits and (use_kernel or (use_kernel is None and auto)):
            from libs.kernels.mla_decode import MLAConfig

            self.kernel_cfg = MLAConfig()

    def num_splits(self, batch_size: int, max_kv: int) -> int:
        """Split-K count for a batch size and an upper bound of its KV lengths (graph-stable)."""
        if self.kernel_cfg is None:
            return 1
        from libs.kernels.mla_decode import choose_num_splits

        return choose_num_splits(batch_size, self.num_heads, max_kv, self.kernel_cfg)

    def prepare(self, batch: ForwardBatch, page_size: int, absorbed: bool) -> StepInputs:
        t, s = batch.input_ids.shape[0], batch.num_seqs
        packed, width = pack_batch(batch, page_size)
        dev = packed.to(self.device)  # the one host -> device copy of the forward
        meta = PagedMetadata(
            page_table=dev[3 * t + s :].view(s, width).to(torch.int32),
            seq_lens=dev[3 * t : 3 * t + s].to(torch.int32),
            page_size=page_size,
            num_splits=self.num_splits(s, width * page_size),
            extend_lens=list(batch.extend_lens),
            kv_lens=list(batch.seq_lens),
        )
        return StepInputs(dev[:t], dev[t : 2 * t], dev[2 * t : 3 * t], meta, self, absorbed)

    def attend(self, q_nope, q_pe, layer_rows, weights, step):
        meta = step.meta
        assert isinstance(meta, PagedMetadata)
        if not step.absorbed:
            return self.extend(q_nope, q_pe, layer_rows, weights, meta)
        q_latent = torch.bmm(q_nope.transpose(0, 1), weights.w_uk).transpose(0, 1)  # [T, H, R]
        latent = self.decode_latent(q_latent, q_pe, layer_rows, meta)  # [T, H, R]
        return torch.bmm(latent.transpose(0, 1), weights.w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]

    def decode_latent(self, q_latent, q_pe, layer_rows, meta: PagedMetadata) -> torch.Tensor:
        if self.kernel_cfg is None:
            return mla_decode_paged(q_latent, q_pe, layer_rows, meta, self.scale)
        if is_fp8(layer_rows) and layer_rows.shape[-1] == q_latent.shape[-1] + q_pe.shape[-1]:
            return mla_decode_paged(q_latent, q_pe, layer_rows, meta, self.scale)  # "tensor" rows: no kernel
        if is_fp8(layer_rows):
            from libs.kernels import mla_decode_fp8 as fp8
            from libs.kernels import mla_decode_fp8_sm90 as sm90
            from libs.kernels import mla_decode_fp8_sm90_seesaw as seesaw

            if sm90.available(q_latent.device, meta.page_size, q_latent.shape[1]):
                kernel = seesaw.mla_decode_fp8_sm90_seesaw if seesaw.chosen() else sm90.mla_decode_fp8_sm90
                return kernel(
                    q_latent, layer_rows, meta.page_table, meta.seq_lens, meta.page_size, self.scale, q_rope=q_pe,
                    num_splits=meta.num_splits,
                )  # fmt: skip
            return fp8.mla_decode_fp8(
                q_latent, layer_rows, meta.page_table, meta.seq_lens, meta.page_size, self.scale,
                q_rope=q_pe, num_splits=meta.num_splits, cfg=self.kernel_cfg, dots=fp8.DECODE_DOTS,
            )  # fmt: skip
        from libs.kernels.mla_decode import mla_decode

        return mla_decode(
            q_latent, layer_rows, meta.page_table, meta.seq_lens, meta.page_size, self.scale,
            num_splits=meta.num_splits, cfg=self.kernel_cfg, q_rope=q_pe.to(q_latent.dtype),
        )  # fmt: skip

    def extend(self, q_nope, q_pe, layer_rows, weights: MLAWeights, meta: PagedMetadata) -> torch.Tensor:
        return mla_extend_sdpa(q_nope, q_pe, layer_rows, weights.dense, meta, self.scale)


class FlashInferAttention(TritonAttention):
    """FlashInfer's MLA decode (eager: planned per forward; in decode graphs: planned on the host before each
    replay) and ragged prefill. FlashInfer takes 16-bit inputs: a float32 model gets the torch paged decode and
    the SDPA prefill; head dims its prefill does not compile for (flashinfer_mla.RAGGED_HEAD_DIMS) get SDPA."""

    name = "flashinfer"
    graph_safe = True  # decode graphs: one wrapper per captured batch size, planned before each replay
    splits_extend = False  # the ragged prefill is planned for the whole forward: TBO runs extend whole

    def __init__(
        self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto",
        fp8_tensor_rows: bool = False,
    ) -> None:  # fmt: skip
        """fp8_tensor_rows: an FP8 pool holds "tensor" rows, which FlashInfer's FP8 decode reads; otherwise FP8
        ("token") rows decode with the FP8 kernels (TritonAttention.decode_latent picks SM90's or Triton's)."""
        fp8 = kv_cache_dtype != "auto"
        super().__init__(cfg, device, dtype, use_kernel=None if fp8 else False, kv_cache_dtype=kv_cache_dtype)
        from libs.kernels import flashinfer_mla

        self.dtype, self.head_dims = dtype, (cfg.qk_head_dim, cfg.v_head_dim)
        self.kv_dtype = torch.float8_e4m3fn if fp8 else dtype  # what FlashInfer's decode is planned for
        half = dtype in (torch.bfloat16, torch.float16)
        fits = half and _kernel_fits(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.mla = flashinfer_mla.FlashInferMLA(device) if fits and (not fp8 or fp8_tensor_rows) else None
        ragged = half and flashinfer_mla.ragged_prefill_fits(*self.head_dims)
        self.prefill = flashinfer_mla.FlashInferRaggedPrefill(device) if ragged else None
        self._kv_index: torch.Tensor | None = None  # [sum K] pool slots of the extend batch's keys
        self._graph_mla: dict[int, flashinfer_mla.FlashInferMLA] = {}  # captured batch size -> its wrapper
        self._active: flashinfer_mla.FlashInferMLA | None = None  # last planned for a graph step (None: eager)
        self.tbo = False  # two-batch overlap on (two_batch_overlap.enable): decode plans one wrapper per part
        self._graph_parts: dict[int, tuple[flashinfer_mla.FlashInferMLA, ...]] = {}  # batch -> micro-batches'
        self._eager_parts: tuple[flashinfer_mla.FlashInferMLA, ...] = ()
        self._parts: tuple[flashinfer_mla.FlashInferMLA, ...] | None = None  # planned for the current step

    def prepare(self, batch: ForwardBatch, page_size: int, absorbed: bool) -> StepInputs:
        step = super().prepare(batch, page_size, absorbed)
        self._active, self._parts = None, None
        meta = step.meta
        assert isinstance(meta, PagedMetadata) and meta.extend_lens is not None and meta.kv_lens is not None
        if absorbed and self.mla is not None:
            self.mla.plan(meta.page_table, meta.seq_lens, page_size, self.num_heads, self.scale, self.dtype,
                          self.kv_dtype)  # fmt: skip
        elif not absorbed and self.prefill is not None:
            key = torch.arange(meta.page_table.shape[1] * page_size, device=self.device)
            per_seq = meta.page_table.long()[:, key // page_size] * page_size + key % page_size  # [S, P*page]
            self._kv_index = torch.cat([per_seq[s, :k] for s, k in enumerate(meta.kv_lens)])
            qk, vo = self.head_dims
            self.prefill.plan(meta.extend_lens, meta.kv_lens, self.num_heads, self.scale, self.dtype, qk, vo)
        return step

    def plan_graph(self, batch: int, seq_lens, page_table, page_size: int) -> None:
        """Before a captured decode step of `batch` rows runs (capture or replay): plan its wrapper from the
        host copies of the step's lengths [B] and page table [B, P] (numpy)."""
        if self.mla is None:
            return
        s = self._split(batch)
        if s is not None:  # the captured forward runs two micro-batches: plan theirs, not the whole batch's
            parts = self._graph_parts.get(batch)
            if parts is None:
                parts = tuple(self._wrapper(n, page_table.shape[1]) for n in (s, batch - s))
                self._graph_parts[batch] = parts
            for part, rows in zip(parts, (slice(0, s), slice(s, None)), strict=True):
                part.plan_host(seq_lens[rows], page_table[rows], page_size, self.num_heads, self.scale, self.dtype,
                               self.kv_dtype)  # fmt: skip
            self._active, self._parts = parts[0], parts
            return
        mla = self._graph_mla.get(batch)
        if mla is None:
            mla = self._wrapper(batch, page_table.shape[1])
            self._graph_mla[batch] = mla
        mla.plan_host(seq_lens, page_table, page_size, self.num_heads, self.scale, self.dtype, self.kv_dtype)
        self._active, self._parts = mla, None

    def _wrapper(self, graph_batch: int | None = None, max_pages: int = 0):
        """A wrapper sharing the eager one's float workspace (the forwards and micro-batches using them run one
        after another on the compute stream)."""
        from libs.kernels import flashinfer_mla

        assert self.mla is not None
        return flashinfer_mla.FlashInferMLA(
            self.device, workspace=self.mla.workspace, graph_batch=graph_batch, max_pages=max_pages
        )

    def _split(self, batch: int) -> int | None:
        """Micro-batch A's sequences when TBO splits a decode forward of `batch` sequences, else None."""
        if not self.tbo:
            return None
        from libs.engine.tbo_split import split_index

        s = split_index([1] * batch)
        return s if 0 < s < batch else None

    def plan_micro_batches(self, meta: PagedMetadata, s: int) -> None:
        """Before TBO runs a decode forward as micro-batches of s and S - s sequences: plan one wrapper for
        each (eagerly; a graph step's were planned by `plan_graph` before the replay)."""
        if self.mla is None or self._active is not None:
            return
        if not self._eager_parts:
            self._eager_parts = (self._wrapper(), self._wrapper())
        for part, rows in zip(self._eager_parts, (slice(0, s), slice(s, None)), strict=True):
            part.plan(meta.page_table[rows], meta.seq_lens[rows], meta.page_size, self.num_heads, self.scale,
                      self.dtype, self.kv_dtype)  # fmt: skip
        self._parts = self._eager_parts

    def decode_latent(self, q_latent, q_pe, layer_rows, meta: PagedMetadata) -> torch.Tensor:
        if self.mla is None:  # "token" FP8 rows (the FP8 kernels), or dims FlashInfer does not take
            return super().decode_latent(q_latent, q_pe, layer_rows, meta)
        mla = self._active if self._active is not None else self.mla
        if meta.part is not None:
            if self._parts is None:
                raise RuntimeError("a micro-batch's FlashInfer decode was not planned (plan_micro_batches)")
            mla = self._parts[meta.part]
        return mla.run(q_latent, q_pe.to(q_latent.dtype), layer_rows, kv_scale=TENSOR_SCALE)

    def extend(self, q_nope, q_pe, layer_rows, weights: MLAWeights, meta: PagedMetadata) -> torch.Tensor:
        if self.prefill is None:
            return super().extend(q_nope, q_pe, layer_rows, weights, meta)
        assert self._kv_index is not None
        h, n, r = self.num_heads, q_nope.shape[-1], q_pe.shape[-1]
        rows = layer_rows[self._kv_index]  # [sum K, C]: every sequence's keys, ragged
        rows = read_rows(rows, weights.dense.shape[1], q_pe.shape[-1], weights.dense.dtype)
        kv = F.linear(rows[:, :-r].to(weights.dense.dtype), weights.dense).view(rows.shape[0], h, -1)
        k = expanded_keys(kv[..., :n], rows[:, -r:])  # [sum K, H, N + r]
        return self.prefill.run(joined_query(q_nope, q_pe), k, kv[..., n:])  # FlashInfer reads v's strides


def _kernel_fits(num_heads: int, latent: int, rope: int) -> bool:
    """The MLA decode kernels' shapes: DeepSeek's 512 + 64 latent row, heads tiled by 16..64."""
    block = min(64, max(16, 1 << (num_heads - 1).bit_length()))
    return latent == 512 and rope == 64 and num_heads % block == 0


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":  # on CUDA: FlashInfer's MLA (in decode graphs too) where it imports, else Triton's
        if device.type != "cuda":
            return "torch"
        from libs.kernels import flashinfer_mla

        return "flashinfer" if flashinfer_mla.available() else "triton"
    if name == "flashinfer":
        from libs.kernels import flashinfer_mla

        if device.type != "cuda" or not flashinfer_mla.available():
            raise ValueError("attention_backend 'flashinfer' needs CUDA and the flashinfer package")
    return name


def fp8_scales(name: str, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> str:
    """The FP8 row layout (libs/engine/kv_fp8.py) a pool should have for backend `name`: "tensor" where
    FlashInfer's FP8 decode reads it (backend "flashinfer" named, CUDA, a 16-bit model, DeepSeek's 512 + 64
    row), else "token". "auto" keeps "token" rows and the project's FP8 kernels (SM90's FP8 MMAs on Hopper):
    FlashInfer's SM90 FP8 decode widens the codes to bf16 in shared memory and is the slower
    (docs/gpu.md#fp8-kv-cache)."""
    resolved = resolve_backend(name, torch.device(device))
    half = dtype in (torch.bfloat16, torch.float16)
    fits = _kernel_fits(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    return "tensor" if name == resolved == "flashinfer" and half and fits else "token"


def make_attention_backend(
    name: str, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, kv_cache_dtype: str = "auto",
    fp8_tensor_rows: bool = False,
) -> AttentionBackend:  # fmt: skip
    """The backend `name` ("auto" | "torch" | "triton" | "flashinfer") for a model's attention shape over KV
    rows of `kv_cache_dtype` ("auto" | "fp8_e4m3"); fp8_tensor_rows: the pool's FP8 rows are "tensor" rows."""
    device = torch.device(device)
    resolved = resolve_backend(name, device)
    if resolved == "torch":
        return TorchAttention(cfg, device, kv_cache_dtype)
    if resolved == "triton":
        return TritonAttention(cfg, device, dtype, kv_cache_dtype=kv_cache_dtype)
    return FlashInferAttention(cfg, device, dtype, kv_cache_dtype, fp8_tensor_rows=fp8_tensor_rows)
