"""CUDA graphs for MTP speculative decoding (libs/engine/speculative.py): the target's verify forward and
the MTP module's draft steps, both run as decode-shaped "rows".

A verify chunk [t_c, d_1..d_k] at positions c..c+k is k+1 rows of a decode step: row j feeds one token at
position c+j, with the sequence's page table and KV length c+j+1. Each layer writes every row's latent row
before any row attends, so row j attends over exactly the chunk's causal prefix 0..c+j: the chunk's
absorbed attention, computed by the decode kernel. The MTP module's extend over verified positions and
its chained single-token steps are rows the same way. So both forwards are decode steps of n rows:
captured per row-count bucket (`capture_sizes`, `bucket_for`) and replayed from the decode graphs'
packed input layout (`DecodeLayout`, `fill_decode_inputs` in libs/engine/cuda_graph.py: padding rows
write the scratch page), plus, for the MTP module, a static [b, D] hidden-state input.

`RowGraphRunner` captures any `body(step, hidden) -> tensors` this way; the caller (MTPEngine) says
what the body is (target: hidden and logits; MTP: its hidden) and falls back to the same rows eagerly
when `can_run` says no or a capture fails. The pure part (`chunk_rows`, `row_chunks`) is tested on CPU.

Legend: n rows, b the captured row count (n padded), D hidden, P pages in the table.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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


def fill_chunk_inputs(
    buf: np.ndarray, layout: DecodeLayout, chunks: Sequence[Chunk], page_size: int, scratch_page: int
) -> int:
    """`fill_decode_inputs` of `chunk_rows(chunks)` without a Python step per row: a chunk's rows share
    one page table (its last row's; entries past a row's own KV are never read); many chunks are packed
    with whole-array ops, a few chunk by chunk. -> n, the rows written (rows n..b-1 are padding)."""
    ids, pos, slots, lens, table = layout.views(buf)
    if 0 < len(chunks) < 8:
        n = _fill_chunk_by_chunk(ids, pos, slots, lens, table, chunks, layout, page_size)
    else:
        n = _fill_all_chunks(ids, pos, slots, lens, table, chunks, layout, page_size)
    ids[n:], pos[n:], lens[n:] = 0, 0, 1
    slots[n:] = scratch_page * page_size
    table[n:, 0] = scratch_page
    return n


def _bad_chunk(i: int, m: int, need: int, have: int, rows: int, layout: DecodeLayout) -> ValueError:
    return ValueError(
        f"chunk {i} ({m} tokens) needs {need} pages, has {have}, graphs hold {layout.max_pages}; "
        f"{rows} rows for {layout.batch}"
    )


def _fill_chunk_by_chunk(ids, pos, slots, lens, table, chunks, layout: DecodeLayout, page_size: int) -> int:
    r = 0
    for i, c in enumerate(chunks):
        m, end = len(c.tokens), c.start + len(c.tokens)
        k = (end - 1) // page_size + 1
        if m < 1 or r + m > layout.batch or k > layout.max_pages or len(c.pages) < k:
            raise _bad_chunk(i, m, k, len(c.pages), r + m, layout)
        if m == 1:  # scalar writes beat array ops
            ids[r], pos[r], lens[r] = c.tokens[0], c.start, end
            table[r, :k] = c.pages[:k]
            slots[r] = c.pages[c.start // page_size] * page_size + c.start % page_size
        else:
            pages = np.asarray(c.pages[:k], dtype=np.int64)
            p = np.arange(c.start, end)
            ids[r : r + m], pos[r : r + m], lens[r : r + m] = c.tokens, p, p + 1
            table[r : r + m, :k] = pages
            slots[r : r + m] = pages[p // page_size] * page_size + p % page_size
        r += m
    return r


def _fill_all_chunks(ids, pos, slots, lens, table, chunks, layout: DecodeLayout, page_size: int) -> int:
    """Whole-array packing: each chunk's pages (need of them) flattened once, rows and table cells indexed."""
    m = np.fromiter((len(c.tokens) for c in chunks), np.int64, len(chunks))
    start = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
    need = (start + m - 1) // page_size + 1
    have = np.fromiter((len(c.pages) for c in chunks), np.int64, len(chunks))
    n = int(m.sum())
    bad = np.flatnonzero((m < 1) | (need > layout.max_pages) | (have < need))
    if not chunks or n > layout.batch or bad.size:
        i = int(bad[0]) if bad.size else 0
        raise (
            _bad_chunk(i, int(m[i]), int(need[i]), int(have[i]), n, layout)
            if chunks
            else ValueError("no rows")
        )
    flat = np.fromiter(
        itertools.chain.from_iterable(c.pages[:k] for c, k in zip(chunks, need.tolist(), strict=True)),
        np.int64,
    )
    first = np.cumsum(need) - need  # each chunk's first page in flat
    chunk_of = np.repeat(np.arange(len(chunks)), m)  # [n]
    p = np.arange(n) - np.repeat(np.cumsum(m) - m, m) + start[chunk_of]
    ids[:n] = np.fromiter(itertools.chain.from_iterable(c.tokens for c in chunks), np.int64, n)
    pos[:n], lens[:n] = p, p + 1
    row_need, row_first = need[chunk_of], first[chunk_of]
    rows = np.repeat(np.arange(n), row_need)
    cols = np.arange(rows.size) - np.repeat(np.cumsum(row_need) - row_need, row_need)
    table[rows, cols] = flat[row_first[rows] + cols]
    slots[:n] = flat[row_first + p // page_size] * page_size + p % page_size
    return n


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
    """Captures and replays `body` over n decode rows, one graph per row-count bucket (lazily, on first
    use, after two eager warm-up runs on padding rows). hidden_dim: the width of the body's hidden input
    (None: no hidden input). All buckets share one memory pool; outputs are views valid until the next
    replay of the same bucket."""

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

    def can_run_chunks(self, chunks: Sequence[Chunk]) -> bool:
        """The chunks' rows fit a captured size and the table width."""
        n = sum(len(c.tokens) for c in chunks)
        if n < 1 or bucket_for(n, self.sizes) is None:
            return False
        return all((c.start + len(c.tokens) - 1) // self.page_size < self.max_pages for c in chunks)

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
        hidden: torch.Tensor | None = None, patch_ids: IdsPatch | None = None,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The body's outputs for n rows ([n, ...] views of the graph's outputs). hidden [n, D]: the rows'
        hidden input (required iff the runner has hidden_dim). patch_ids: writes token ids the host does
        not know (drafts still on the device) into the rows' device ids [n] before the replay; `tokens`
        holds placeholders there. GraphCaptureError: nothing replayed."""

        def fill(buf: np.ndarray, layout: DecodeLayout) -> None:
            fill_decode_inputs(buf, layout, tokens, positions, tables, self.page_size, self.scratch_page)

        return self._run(len(tokens), fill, hidden, patch_ids)

    def run_chunks(
        self, chunks: Sequence[Chunk], hidden: torch.Tensor | None = None, patch_ids: IdsPatch | None = None
    ) -> tuple[torch.Tensor, ...]:
        """`run` over `chunk_rows(chunks)`, packed chunk by chunk (`fill_chunk_inputs`)."""

        def fill(buf: np.ndarray, layout: DecodeLayout) -> None:
            fill_chunk_inputs(buf, layout, chunks, self.page_size, self.scratch_page)

        return self._run(sum(len(c.tokens) for c in chunks), fill, hidden, patch_ids)

    def _run(
        self, n: int, fill: Callable[[np.ndarray, DecodeLayout], None], hidden: torch.Tensor | None,
        patch_ids: IdsPatch | None,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
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
        fill(g.staging.numpy(), g.layout)
        self._plan(g)
        g.packed.copy_(g.staging, non_blocking=True)
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

    def _capture(self, b: int) -> _Graph:
        layout = DecodeLayout(b, self.max_pages)
        hidden = None
        if self.hidden_dim is not None:
            hidden = torch.zeros(b, self.hidden_dim, dtype=self.hidden_dtype, device=self.device)
        g = _Graph(
            layout,
            staging=torch.zeros(layout.size, dtype=torch.int32, pin_memory=True),
            packed=torch.zeros(layout.size, dtype=torch.int32, device=self.device),
            hidden=hidden,
            copied=torch.cuda.Event(),
        )
        fill_decode_inputs(
            g.staging.numpy(), layout, [0], [0], [[self.scratch_page]], self.page_size, self.scratch_page
        )
        g.packed.copy_(g.staging)
        self._plan(g)

        def step() -> tuple[torch.Tensor, ...]:
            return self.body(static_step(g.packed, layout, self.page_size, self.backend), g.hidden)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g.graph, g.outputs = capture(step, self._pool)
        self._graphs[b] = g
        return g
