"""CUDA graphs for MTP speculative decoding (speculative.py): the target's verify forward and the MTP module's
draft steps, both run as decode-shaped rows and captured per row-count bucket by `RowGraphRunner`. The
pure part (`chunk_rows`, `row_chunks`) is tested on CPU."""

# Legend: n rows, b the captured row count (n padded), D hidden, P pages in the table.
# A verify chunk [t_c, d_1..d_k] at positions c..c+k is k+1 decode rows: row j feeds one token at c+j with
# KV length c+j+1. Each layer writes every row's latent row before any row attends, so row j sees exactly
# the chunk's causal prefix: the chunk's absorbed attention, by the decode kernel. MTP's extend and chained
# steps are rows the same way. Inputs use the decode graphs' packed layout (cuda_graph.DecodeLayout,
# fill_decode_inputs), plus a static [b, D] hidden input for the MTP module. The caller (MTPEngine) falls
# back to the same rows eagerly when `can_run` says no or a capture fails.

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from libs.engine.cuda_graph import (
    DecodeLayout,
    GraphCaptureError,
    bucket_for,
    capture,
    fill_decode_inputs,
    plan_replay,
    static_step,
)
from libs.engine.layers.attention_backend import AttentionBackend, StepInputs, TritonAttention
from libs.engine.runner import Chunk

Body = Callable[[StepInputs, torch.Tensor | None], tuple[torch.Tensor, ...]]
IdsPatch = Callable[[torch.Tensor], object]  # rows' input ids [n] on the device -> written in place


def chunk_rows(chunks: Sequence[Chunk]) -> tuple[list[int], list[int], list[list[int]]]:
    """Chunks -> one decode row per token: (tokens, positions, page tables), chunk after chunk."""
    tokens: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    for c in chunks:
        tokens += c.tokens
        positions += range(c.start, c.start + len(c.tokens))
        tables += [c.pages] * len(c.tokens)
    return tokens, positions, tables


def row_chunks(chunks: Sequence[Chunk]) -> list[Chunk]:
    """The same rows as one-token chunks, for the eager forward of the same decode step."""
    return [Chunk([t], p, pages) for t, p, pages in zip(*chunk_rows(chunks), strict=True)]


@dataclass
class _Graph:
    layout: DecodeLayout
    staging: torch.Tensor  # pinned host int32 [layout.size]
    packed: torch.Tensor  # device int32 [layout.size]
    hidden: torch.Tensor | None  # device [b, D]: the body's hidden-state input (None: the body takes none)
    copied: torch.cuda.Event  # the last host->device copy from staging is done
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, ...] = ()


class RowGraphRunner:
    """Captures (lazily, after two eager warm-up runs) and replays `body` over n decode rows, one graph per
    row-count bucket sharing one memory pool; outputs are views valid until that bucket's next replay.
    hidden_dim: the width of the body's hidden input (None: none)."""

    def __init__(
        self, body: Body, backend: AttentionBackend, sizes: Sequence[int], *, page_size: int, scratch_page: int,
        max_pages: int, device: torch.device, hidden_dim: int | None = None, hidden_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        if not isinstance(backend, TritonAttention) or not backend.graph_safe:
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in a CUDA graph")
        if max_pages < 1 or not sizes or (hidden_dim is not None and hidden_dtype is None):
            raise ValueError(
                f"bad row graph setup: max_pages {max_pages}, sizes {sizes}, hidden {hidden_dim}"
            )
        self.body, self.backend, self.sizes = body, backend, sorted(sizes)
        self.page_size, self.scratch_page, self.max_pages = page_size, scratch_page, max_pages
        self.device, self.hidden_dim, self.hidden_dtype = device, hidden_dim, hidden_dtype
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # one memory pool for every bucket, made at the first capture

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def can_run(self, n: int, positions: Sequence[int]) -> bool:
        """n rows at `positions` fit a captured size and the table width."""
        if n < 1 or bucket_for(n, self.sizes) is None:
            return False
        return all(p // self.page_size < self.max_pages for p in positions)

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
        hidden: torch.Tensor | None = None, patch_ids: IdsPatch | None = None,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The body's outputs for n rows ([n, ...] views). hidden [n, D]: required iff the runner has
        hidden_dim. patch_ids: device token ids (drafts) written over `tokens`' placeholders before the
        replay. GraphCaptureError: nothing replayed."""
        n = len(tokens)
        b = bucket_for(n, self.sizes)
        if b is None:
            raise ValueError(f"{n} rows exceed the largest captured size {self.sizes[-1]}")
        if (hidden is None) != (self.hidden_dim is None) or (hidden is not None and hidden.shape[0] != n):
            raise ValueError(f"hidden input {None if hidden is None else tuple(hidden.shape)} for {n} rows")
        g = self._graphs.get(b)
        if g is None:
            try:
                g = self._capture(b)
            except Exception as e:
                raise GraphCaptureError(f"capturing {n} rows (bucket {b}) failed: {e!r}") from e
        g.copied.synchronize()  # staging may be rewritten only once its last copy is done
        columns = fill_decode_inputs(
            g.staging.numpy(), g.layout, tokens, positions, tables, self.page_size, self.scratch_page
        )
        self._plan(g)
        used = g.layout.prefix(columns)  # the table columns these rows read, not the whole context's
        g.packed[:used].copy_(g.staging[:used], non_blocking=True)
        if patch_ids is not None:
            patch_ids(g.packed[:n])
        if hidden is not None and g.hidden is not None:
            g.hidden[:n].copy_(hidden)
        g.copied.record()
        assert g.graph is not None
        g.graph.replay()
        return tuple(o[:n] for o in g.outputs)

    def _plan(self, g: _Graph) -> None:
        plan_replay(self.backend, g.layout, g.staging, self.page_size)

    def _inputs(self, b: int, pin: bool, copied: Any) -> tuple[_Graph, Callable[[], tuple[torch.Tensor, ...]]]:
        """A graph's static inputs for b rows, filled with one scratch row, and the step it captures."""
        layout = DecodeLayout(b, self.max_pages)
        hidden = None
        if self.hidden_dim is not None:
            hidden = torch.zeros(b, self.hidden_dim, dtype=self.hidden_dtype, device=self.device)
        g = _Graph(
            layout,
            staging=torch.zeros(layout.size, dtype=torch.int32, pin_memory=pin),
            packed=torch.zeros(layout.size, dtype=torch.int32, device=self.device),
            hidden=hidden,
            copied=copied,
        )
        fill_decode_inputs(
            g.staging.numpy(), layout, [0], [0], [[self.scratch_page]], self.page_size, self.scratch_page
        )
        g.packed.copy_(g.staging)

        def step() -> tuple[torch.Tensor, ...]:
            return self.body(static_step(g.packed, layout, self.page_size, self.backend), g.hidden)

        return g, step

    def _capture(self, b: int) -> _Graph:
        g, step = self._inputs(b, pin=True, copied=torch.cuda.Event())
        self._plan(g)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g.graph, g.outputs = capture(step, self._pool)
        self._graphs[b] = g
        return g
