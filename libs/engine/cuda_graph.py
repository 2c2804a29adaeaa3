"""CUDA graphs for decode steps: the model's decode forward (embedding .. logits) captured once per batch size
and replayed with new inputs; a batch of n runs in the graph of the smallest captured size b >= n, rows
n..b-1 padding. The pure parts (`capture_sizes`, `bucket_for`, `fill_decode_inputs`) are tested on CPU."""

# Inputs: one pinned int32 buffer [ids b | positions b | out_slots b | seq_lens b | page table P * b]
# (`DecodeLayout`), one host->device copy, then the replay. The table is column-major, so the pages a step
# reads are one prefix of the buffer and only that prefix is copied, not b x P (P: the model's whole context
# in pages). Padding rows are token 0 at position 0, writing into a scratch page no sequence owns, seq_len 1;
# their logits are dropped. Graph-safe inside: shapes depend on b and P only, no host reads of device values,
# no tensors from lists; that holds for attention backends with `graph_safe` and models whose
# `graph_safe_decode()` is True. Graphs are captured lazily, after two eager warm-up runs on padding rows
# (compilation happens there, never during capture); all sizes share one memory pool (one replays at a time).

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from libs.engine.kv_pool import KVPool
from libs.engine.layers.attention_backend import (
    AttentionBackend,
    StepInputs,
    TritonAttention,
    resolve_backend,
)
from libs.engine.layers.mla import PagedMetadata

T = TypeVar("T")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds n rows, or None when n exceeds them all."""
    if n < 1:
        raise ValueError(f"a decode batch needs at least one sequence, got {n}")
    return next((b for b in sorted(sizes) if b >= n), None)


@dataclass(frozen=True)
class DecodeLayout:
    """Offsets of one batch size's packed int32 input buffer."""

    batch: int
    max_pages: int

    @property
    def size(self) -> int:
        return self.batch * (4 + self.max_pages)

    def prefix(self, pages: int) -> int:
        """How many leading int32s of the buffer hold the row inputs and the table's first `pages` columns."""
        return self.batch * (4 + pages)

    def views(self, buf):
        """buf (numpy array or tensor of `size`) -> ids, positions, out_slots, seq_lens [b], table [b, P] (a
        column-major view: strides (1, b))."""
        b = self.batch
        table = buf[4 * b :].reshape(self.max_pages, b).T
        return buf[:b], buf[b : 2 * b], buf[2 * b : 3 * b], buf[3 * b : 4 * b], table


def fill_decode_inputs(
    buf: np.ndarray,
    layout: DecodeLayout,
    tokens: Sequence[int],
    positions: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    scratch_page: int,
    written: list[tuple[Sequence[int] | None, int]] | None = None,
) -> int:
    """Write n <= b decode rows (one new token each at `positions`) and b - n padding rows into buf; returns
    the table columns the step reads (`layout.prefix(columns)` is what the device needs). `written`, kept
    with buf between calls, lets rows whose page lists only grew be updated, not rewritten."""
    # `written[i]` is (page list, entries written) of table row i. A list in the same row as last time gets
    # its new entries only; one that moved rows is moved with the others in one array copy; new lists are
    # written whole. This relies on the engine's page lists growing in place only (released, preempted or
    # truncated, a request gets a new list); the last carried entry is checked, a failing row rewritten.
    # Table entries past a row's pages keep stale (valid) ids: nothing reads beyond seq_len.
    n = len(tokens)
    if not 1 <= n <= layout.batch or len(positions) != n or len(page_tables) != n:
        raise ValueError(
            f"{n} tokens, {len(positions)} positions, {len(page_tables)} page tables for a batch of {layout.batch}"
        )
    ids, pos, slots, lens, table = layout.views(buf)
    ids[:n], pos[:n] = tokens, positions
    lens[:n] = np.asarray(positions) + 1
    starts = _carry_rows(table, written, page_tables) if written is not None else []
    columns = 1
    for i, (p, pages) in enumerate(zip(positions, page_tables, strict=True)):
        need = p // page_size + 1
        columns = max(columns, need)
        if need > layout.max_pages or len(pages) < need:
            raise ValueError(
                f"row {i}: position {p} needs {need} pages; it has {len(pages)}, graphs hold {layout.max_pages}"
            )
        if written is None:
            table[i, :need] = pages[:need]
        else:
            w = starts[i]
            if not 0 < w <= need or table[i, w - 1] != pages[w - 1]:
                w = 0
            if need > w:
                table[i, w:need] = pages[w:need]
            written[i] = (pages, need)
        slots[i] = pages[p // page_size] * page_size + p % page_size
    ids[n:], pos[n:], lens[n:] = 0, 0, 1
    slots[n:] = scratch_page * page_size
    table[n:, 0] = scratch_page
    if written is not None:
        for i in range(n, layout.batch):
            if written[i][0] is not None:
                written[i] = (None, 0)
    return columns


def _carry_rows(
    table: np.ndarray, written: list[tuple[Sequence[int] | None, int]], page_tables: Sequence[Sequence[int]]
) -> list[int]:
    """For each new row, how many leading table entries are already in place: its list's, moved from the row
    it held last time (all moves in one copy; the right side is copied before it is written, so moves may
    overlap). 0 for a list the table does not hold. (`written` holds the lists, so no id is reused.)"""
    where = {id(p): j for j, (p, _) in enumerate(written) if p is not None}
    starts, src, dst = [], [], []
    for i, pages in enumerate(page_tables):
        j = where.get(id(pages))
        starts.append(0 if j is None else written[j][1])
        if j is not None and j != i:
            src.append(j)
            dst.append(i)
    if src:
        width = max(written[j][1] for j in src)  # the columns in use, not the whole context's P
        table[dst, :width] = table[src, :width]
    return starts


def decode_graphs_supported(model, attention_backend: str) -> bool:
    """Whether decode steps of `model` with that backend name can run as CUDA graphs."""
    if model.device.type != "cuda" or not model.graph_safe_decode():
        return False
    return resolve_backend(attention_backend, model.device) in ("triton", "flashinfer")


def static_step(
    packed: torch.Tensor, layout: DecodeLayout, page_size: int, backend: TritonAttention
) -> StepInputs:
    """The decode StepInputs over views of a packed int32 input buffer: what a captured step reads. Call it
    inside the captured region: the int64 copy of the slots it makes must be part of the graph."""
    ids, pos, slots, lens, table = layout.views(packed)
    splits = backend.num_splits(layout.batch, layout.max_pages * page_size)
    meta = PagedMetadata(table, lens, page_size, splits)
    return StepInputs(ids, pos, slots.long(), meta, backend, absorbed=True)


@dataclass
class _Graph:
    layout: DecodeLayout
    staging: torch.Tensor  # pinned host int32 [layout.size]
    packed: torch.Tensor  # device int32 [layout.size]
    copied: torch.cuda.Event  # the last host->device copy from staging is done
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [b, V] float32: the captured output
    written: list = field(default_factory=list)  # fill_decode_inputs' memo of staging's table rows


def plan_replay(backend, layout: DecodeLayout, staging: torch.Tensor, page_size: int) -> None:
    """Backends that plan on the host (FlashInfer) plan a captured step's lengths and page table (read from
    its pinned staging buffer) before it is captured or replayed."""
    plan = getattr(backend, "plan_graph", None)
    if plan is not None:
        _, _, _, lens, table = layout.views(staging.numpy())
        plan(layout.batch, lens, table, page_size)


def capture(step: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Two warm-up runs of `step` on a side stream, then one captured into a graph on `pool`; -> the graph and
    the captured run's outputs (static tensors each replay rewrites). thread_local: CUDA calls of other threads
    (a worker's event loop) must not invalidate the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph, out


class GraphCaptureError(RuntimeError):
    """A decode forward could not be captured (something in it is not graph-safe); nothing was replayed,
    and the warm-up runs only wrote the scratch page, so the caller can go on eagerly."""


class DecodeGraphRunner:
    """Captures and replays decode forwards; the caller (ModelRunner) falls back to eager when
    `can_run` says no (prefill chunks, more sequences than the largest size, longer contexts)."""

    def __init__(
        self, model, kv_pool: KVPool, backend: AttentionBackend, sizes: Sequence[int], scratch_page: int,
        max_pages: int,
    ) -> None:  # fmt: skip
        if not isinstance(backend, TritonAttention) or not backend.graph_safe:
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in a CUDA graph")
        if not 0 <= scratch_page < kv_pool.num_pages or max_pages < 1 or not sizes:
            raise ValueError(
                f"bad graph setup: scratch page {scratch_page}, max_pages {max_pages}, sizes {sizes}"
            )
        self.model, self.kv_pool, self.backend = model, kv_pool, backend
        self.sizes, self.scratch_page, self.max_pages = sorted(sizes), scratch_page, max_pages
        self.page_size = kv_pool.page_size
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def can_run(self, tokens: Sequence[Sequence[int]], starts: Sequence[int]) -> bool:
        """A pure decode batch (one token per sequence) that fits a captured size and the table width."""
        if bucket_for(len(tokens), self.sizes) is None or any(len(t) != 1 for t in tokens):
            return False
        return self.can_run_decode(len(tokens), starts)

    def can_run_decode(self, n: int, positions: Sequence[int]) -> bool:
        """n decode rows at `positions` fit a captured size and the table width."""
        if bucket_for(n, self.sizes) is None:
            return False
        return all(p // self.page_size < self.max_pages for p in positions)

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], page_tables: Sequence[Sequence[int]],
        token_src: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[n, V] logits of n decode rows (float32, or the model dtype on the fused path), a view valid until the
        next run. token_src [n] (device), when given, replaces `tokens`: overlapped decode feeds the previous
        step's samples without a host round trip."""
        b = bucket_for(len(tokens), self.sizes)
        if b is None:
            raise ValueError(f"{len(tokens)} sequences exceed the largest captured batch {self.sizes[-1]}")
        g = self._graphs.get(b)
        if g is None:
            try:
                g = self._capture(b)
            except Exception as e:
                raise GraphCaptureError(f"capturing the decode step for batch size {b} failed: {e!r}") from e
        g.copied.synchronize()  # the staging buffer may be rewritten only once its last copy is done
        columns = fill_decode_inputs(
            g.staging.numpy(), g.layout, tokens, positions, page_tables, self.page_size, self.scratch_page,
            g.written,
        )  # fmt: skip
        self._plan(g)
        used = g.layout.prefix(columns)  # the rows' inputs and the table columns this step reads
        g.packed[:used].copy_(g.staging[:used], non_blocking=True)
        if token_src is not None:
            g.packed[: len(positions)].copy_(token_src)
        g.copied.record()  # staging and the host plan's buffers may be rewritten once this has passed
        assert g.graph is not None and g.logits is not None
        g.graph.replay()
        return g.logits[: len(tokens)]

    def _plan(self, g: _Graph) -> None:
        plan_replay(self.backend, g.layout, g.staging, self.page_size)

    def _capture(self, b: int) -> _Graph:
        layout = DecodeLayout(b, self.max_pages)
        g = _Graph(
            layout,
            staging=torch.zeros(layout.size, dtype=torch.int32, pin_memory=True),
            packed=torch.zeros(layout.size, dtype=torch.int32, device=self.model.device),
            copied=torch.cuda.Event(),
            written=[(None, 0)] * layout.batch,
        )
        fill_decode_inputs(
            g.staging.numpy(), layout, [0], [0], [[self.scratch_page]], self.page_size, self.scratch_page
        )
        g.packed.copy_(g.staging)
        self._plan(g)

        def step() -> torch.Tensor:
            inputs = static_step(g.packed, layout, self.page_size, self.backend)
            hidden = self.model.forward_step(inputs, self.kv_pool)
            return self.model.compute_logits(hidden, raw=self.model.uses_fast_path(self.backend))

        g.graph, g.logits = capture(step, self._pool)
        self._graphs[b] = g
        return g
