"""Paged latent KV pool: one MLA latent row (kv_lora_rank + qk_rope_head_dim values) per token per layer, in one
contiguous tensor [L, P * page_size, C]; page p covers slots [p * page_size, (p + 1) * page_size). A run of
pages is one contiguous byte range per layer (`page_run_span`), so KV transfer moves a run with one write."""

# The KV transfer layer registers `buffer` once.

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        row_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.row_dim = row_dim
        self.dtype = dtype
        self.buffer = torch.zeros(num_layers, num_pages * page_size, row_dim, dtype=dtype, device=device)

    def layer(self, layer_id: int) -> torch.Tensor:
        """[P * page_size, C] view of one layer's rows."""
        return self.buffer[layer_id]

    def write(self, layer_id: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.buffer[layer_id].index_copy_(0, slots, rows.to(self.dtype))

    def gather(self, layer_id: int, page_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[seq_len, C] rows of one sequence, in token order."""
        rows = self.buffer[layer_id].view(self.num_pages, self.page_size, self.row_dim)[page_table]
        return rows.reshape(-1, self.row_dim)[:seq_len]

    # --- byte geometry for the KV transfer layer ---
    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page in one layer."""
        return self.page_size * self.row_dim * self.buffer.element_size()

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
