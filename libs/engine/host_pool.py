"""The host tier's KV pages in host RAM (pinned beside a CUDA pool), page-major [H, L, page_size, C]: one page of
every layer is one contiguous range. The engine thread allocates, frees and copies (`to_host`, `to_device`); the
store tier's thread reads and writes the bytes (`page_ptr`) of pages allocated for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from libs.engine.kv_pool import KVPool
from libs.engine.pages import PageAllocator


class HostKVPool:
    def __init__(self, pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the host KV pool needs num_pages >= 1, got {num_pages}")
        self.device = pool.buffer.device
        self.num_pages = num_pages
        # rows as the pool stores them: row_dim values, or an FP8 pool's row bytes (scales inside)
        self.page_size, self.num_layers, self.row_dim = pool.page_size, pool.num_layers, pool.buffer.shape[-1]
        cuda = self.device.type == "cuda"
        self.buffer = torch.zeros(
            num_pages, pool.num_layers, pool.page_size, self.row_dim, dtype=pool.buffer.dtype, pin_memory=cuda
        )
        self.allocator = PageAllocator(num_pages)
        self._pool = pool
        self._stream: Any = torch.cuda.Stream(self.device) if cuda else None
        self._deferred: list[tuple[Any, list[int]]] = []  # (event, pages): freed once the event completed

    # --- geometry (the store tier) ---
    @property
    def page_bytes(self) -> int:
        """Bytes of one host page (every layer)."""
        return self.num_layers * self.page_size * self.row_dim * self.buffer.element_size()

    def page_ptr(self, page: int) -> int:
        return self.buffer[page].data_ptr()

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    # --- pages ---
    @property
    def num_free(self) -> int:
        self.reap()
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def alloc(self, n: int) -> list[int]:
        self.reap()
        return self.allocator.alloc(n)

    def free(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    def free_after(self, fence: Any, pages: Sequence[int]) -> None:
        """Drop a reference per page once `fence` (a copy's CUDA event; None: done already) completed."""
        if fence is None:
            self.allocator.free(pages)
        else:
            self._deferred.append((fence, list(pages)))

    def reap(self) -> None:
        """Free the pages whose copies completed."""
        if self._deferred:
            keep = []
            for fence, pages in self._deferred:
                if fence.query():
                    self.allocator.free(pages)
                else:
                    keep.append((fence, pages))
            self._deferred = keep

    # --- copies (engine thread) ---
    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Any:
        """Copy device pages into host pages; returns a fence (None on CPU: already copied). The device pages
        may be reused as soon as this returns (the compute stream waits for the gather)."""
        src = self._device_view()
        idx = torch.tensor(list(device_pages), dtype=torch.long, device=self.device)
        if self._stream is None:
            self.buffer[torch.tensor(list(host_pages), dtype=torch.long)] = src[:, idx].transpose(0, 1)
            return None
        main, side = torch.cuda.current_stream(self.device), self._stream
        side.wait_stream(main)  # the pages' rows were written by kernels queued on the compute stream
        idx.record_stream(side)  # made on the compute stream, read on the side one
        with torch.cuda.stream(side):
            staged = src[:, idx].transpose(0, 1).contiguous()  # [n, L, ps, C] on the device
            gathered = torch.cuda.Event()
            gathered.record(side)
            for start, first, count in _runs(host_pages):
                self.buffer[first : first + count].copy_(staged[start : start + count], non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(gathered)
        return done

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Any:
        """Copy host pages into device pages; the compute stream waits for it. Returns a fence after which the
        host pages may be overwritten (None on CPU)."""
        dst = self._device_view()
        idx = torch.tensor(list(device_pages), dtype=torch.long, device=self.device)
        if self._stream is None:
            rows = self.buffer[torch.tensor(list(host_pages), dtype=torch.long)]
            dst[:, idx] = rows.transpose(0, 1)
            return None
        main, side = torch.cuda.current_stream(self.device), self._stream
        side.wait_stream(main)  # freshly allocated pages may still be read by queued kernels
        idx.record_stream(side)
        with torch.cuda.stream(side):
            staged = torch.empty(
                (len(device_pages), *self.buffer.shape[1:]), dtype=self.buffer.dtype, device=self.device
            )
            for start, first, count in _runs(host_pages):
                staged[start : start + count].copy_(self.buffer[first : first + count], non_blocking=True)
            dst[:, idx] = staged.transpose(0, 1)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)
        return done

    def _device_view(self) -> torch.Tensor:
        p = self._pool
        return p.buffer.view(p.num_layers, p.num_pages, p.page_size, self.row_dim)


def _runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in `pages`, first page, count) of each run of consecutive page ids."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if out and out[-1][1] + out[-1][2] == p:
            s, f, c = out[-1]
            out[-1] = (s, f, c + 1)
        else:
            out.append((i, p, 1))
    return out
