"""Paged latent KV pool: one MLA latent row (kv_lora_rank + qk_rope_head_dim values) per token per layer, in one
contiguous tensor [L, P * page_size, W]; page p covers slots [p * page_size, (p + 1) * page_size). A run of
pages is one contiguous byte range per layer (`page_run_span`), so KV transfer moves a run with one write."""

# W = C = kv_lora_rank + rope dim values in the model dtype, or with `fp8` the FP8 row's bytes as uint8
# (libs/engine/kv_fp8.py, scales inside the row). The KV transfer layer registers `buffer` once.

from __future__ import annotations

import torch

from libs.engine.kv_fp8 import Fp8Rows


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        row_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fp8: Fp8Rows | None = None,
    ) -> None:
        """dtype: what rows are written and read as; fp8: store them as FP8 rows of that format instead."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        if fp8 is not None and fp8.latent + fp8.rope != row_dim:
            raise ValueError(f"FP8 rows of {fp8.latent} + {fp8.rope} values do not match row_dim {row_dim}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.row_dim = row_dim
        self.row_dtype = dtype
        self.fp8 = fp8
        width, store = (row_dim, dtype) if fp8 is None else (fp8.row_bytes, torch.uint8)
        self.dtype = store
        self.buffer = torch.zeros(num_layers, num_pages * page_size, width, dtype=store, device=device)

    @property
    def kv_cache_dtype(self) -> str:
        """The format of a row as the kv_cache_dtype setting names it ("auto" or "fp8_e4m3")."""
        return "auto" if self.fp8 is None else "fp8_e4m3"

    @property
    def row_width(self) -> int:
        """Elements of `dtype` per stored row: row_dim, or an FP8 row's bytes."""
        return self.buffer.shape[-1]

    @property
    def format_name(self) -> str:
        """What a page's bytes mean, for peers that exchange pages: the row dtype, or the FP8 layout's name
        ("fp8_e4m3", "fp8_e4m3_tensor")."""
        return str(self.row_dtype).removeprefix("torch.") if self.fp8 is None else self.fp8.name

    def layer(self, layer_id: int) -> torch.Tensor:
        """[P * page_size, W] view of one layer's rows (raw bytes for an FP8 pool)."""
        return self.buffer[layer_id]

    def write(self, layer_id: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [T, C] values into `slots` [T] (quantized for an FP8 pool)."""
        data = rows.to(self.dtype) if self.fp8 is None else self.fp8.quantize(rows)
        self.buffer[layer_id].index_copy_(0, slots, data)

    def gather(self, layer_id: int, page_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[seq_len, C] rows of one sequence, in token order, as values in the row dtype."""
        width = self.row_width
        rows = self.buffer[layer_id].view(self.num_pages, self.page_size, width)[page_table]
        rows = rows.reshape(-1, width)[:seq_len]
        return rows if self.fp8 is None else self.fp8.dequantize(rows, self.row_dtype)

    def fill_normal_(self, std: float = 1.0, generator: torch.Generator | None = None) -> None:
        """Every row random N(0, std^2) values, as if prompts had been prefilled (benchmarks)."""
        for layer in self.buffer:
            for start in range(0, layer.shape[0], 1 << 16):  # bounded temporaries on a big pool
                part = layer[start : start + (1 << 16)]
                rows = torch.randn(part.shape[0], self.row_dim, device=part.device, generator=generator) * std
                part.copy_(rows.to(self.dtype) if self.fp8 is None else self.fp8.quantize(rows))

    # --- byte geometry for the KV transfer layer ---
    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page in one layer (an FP8 pool's scales included)."""
        return self.page_size * self.row_width * self.buffer.element_size()

    @property
    def layer_stride_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def page_run_span(self, layer_id: int, first_page: int, num_pages: int) -> tuple[int, int]:
        """(byte offset from data_ptr(), length) of `num_pages` consecutive pages of one layer."""
        return layer_id * self.layer_stride_bytes + first_page * self.bytes_per_page, num_pages * self.bytes_per_page


def row_bytes(row_dim: int, dtype: torch.dtype, fp8: Fp8Rows | None) -> int:
    """Bytes of one token's row in one layer."""
    return row_dim * torch.empty((), dtype=dtype).element_size() if fp8 is None else fp8.row_bytes
