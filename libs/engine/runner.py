"""Turns planned chunks into one ForwardBatch, runs the model, and returns logits. A `Chunk` is the part of
one sequence fed in a forward: its new tokens, the first one's position, and the sequence's page table
(already covering start + len(tokens)), so it continues exactly where the sequence's rows end."""

# Legend: T new tokens, S sequences (chunks), V vocabulary.

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.engine.cuda_graph import DecodeGraphRunner, GraphCaptureError
from libs.engine.forward_batch import ForwardBatch
from libs.engine.kv_pool import KVPool
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM

log = logging.getLogger("moemesh.engine")


@dataclass
class Chunk:
    tokens: list[int]
    start: int  # position of tokens[0] (= KV rows already in place for this sequence)
    pages: list[int]


def build_batch(chunks: Sequence[Chunk], page_size: int) -> ForwardBatch:
    if not chunks or any(not c.tokens for c in chunks):
        raise ValueError("a forward needs at least one chunk, each with at least one token")
    ids, pos, slots, tables = [], [], [], []
    for c in chunks:
        end = c.start + len(c.tokens)
        if len(c.pages) * page_size < end:
            raise ValueError(
                f"chunk ends at token {end} but its {len(c.pages)} pages hold {len(c.pages) * page_size}"
            )
        table = torch.tensor(c.pages, dtype=torch.int64)
        p = torch.arange(c.start, end, dtype=torch.int64)
        ids.append(torch.tensor(c.tokens, dtype=torch.int64))
        pos.append(p)
        slots.append(table[p // page_size] * page_size + p % page_size)
        tables.append(table)
    return ForwardBatch(
        input_ids=torch.cat(ids),
        positions=torch.cat(pos),
        out_slots=torch.cat(slots),
        extend_lens=[len(c.tokens) for c in chunks],
        seq_lens=[c.start + len(c.tokens) for c in chunks],
        page_tables=tables,
    )


class ModelRunner:
    """Owns the model's attention backend (layers/attention_backend.py), its decode CUDA graphs and the pool it
    writes to; the engine decides what to run. graph_batch_sizes: decode batch sizes captured on first use
    (empty: eager only), which needs `scratch_page`, a pool page no sequence gets, for padding rows."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_pool: KVPool,
        *,
        attention_backend: str = "auto",
        graph_batch_sizes: Sequence[int] = (),
        scratch_page: int | None = None,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.backend = model.attention_backend(attention_backend, kv_pool)
        self.graphs: DecodeGraphRunner | None = None
        if graph_batch_sizes:
            if scratch_page is None:
                raise ValueError("decode CUDA graphs need a scratch page for their padding rows")
            cfg, page_size = model.config, kv_pool.page_size
            max_pages = min(-(-cfg.max_position_embeddings // page_size), kv_pool.num_pages)
            self.graphs = DecodeGraphRunner(
                model, kv_pool, self.backend, graph_batch_sizes, scratch_page, max_pages
            )

    def forward_last(self, chunks: Sequence[Chunk], want: Sequence[bool] | None = None) -> torch.Tensor:
        """[S', V] float32 logits at the last token of each chunk with want[i] (all chunks when None).
        From a decode graph (want None) the result is a view of the graph's output: use it before the
        next forward."""
        if self.graphs is not None and self.graphs.can_run(
            [c.tokens for c in chunks], [c.start for c in chunks]
        ):
            try:
                logits = self.graphs.run(
                    [c.tokens[0] for c in chunks], [c.start for c in chunks], [c.pages for c in chunks]
                )
            except GraphCaptureError:
                log.warning("decode CUDA graphs off for this engine: capture failed", exc_info=True)
                self.graphs = None
                return self.forward_last(chunks, want)
            if want is None:
                return logits
            return logits[_rows(want, logits.device)]
        batch = build_batch(chunks, self.kv_pool.page_size)
        hidden = self.model(batch, self.kv_pool, backend=self.backend)  # [T, D]
        last = batch.last_token_index().to(hidden.device)
        if want is not None:
            last = last[_rows(want, hidden.device)]
        return self.model.compute_logits(hidden[last], raw=self.model.uses_fast_path(self.backend))

    def can_graph_decode(self, n: int, positions: Sequence[int]) -> bool:
        return self.graphs is not None and self.graphs.can_run_decode(n, positions)

    def decode_graph(
        self, tokens: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
        token_src: torch.Tensor | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """One decode step on the captured graph (DecodeGraphRunner.run); None when graphs are off or the
        capture failed (nothing ran)."""
        if self.graphs is None:
            return None
        try:
            return self.graphs.run(tokens, positions, pages, token_src=token_src)
        except GraphCaptureError:
            log.warning("decode CUDA graphs off for this engine: capture failed", exc_info=True)
            self.graphs = None
            return None

    def forward_all(self, chunk: Chunk) -> torch.Tensor:
        """[len(chunk.tokens), V] float32 logits at every new token of one chunk."""
        batch = build_batch([chunk], self.kv_pool.page_size)
        return self.model.compute_logits(self.model(batch, self.kv_pool, backend=self.backend))


def _rows(want: Sequence[bool], device: torch.device) -> torch.Tensor:
    """The indices of the chunks that sample, made on the host: a boolean mask would be turned into indices on
    the device (nonzero), making the host wait there for the whole forward before it queues the logits."""
    return torch.tensor([i for i, w in enumerate(want) if w], dtype=torch.long, device=device)
