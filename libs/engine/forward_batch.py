"""The contract between the engine's batcher side and the model: one forward over a flat batch. The runtime
builds a ForwardBatch; the model writes the new tokens' latent KV rows into the KVPool at `out_slots` and
attends over each sequence's pages."""

# Legend: T new tokens in this forward (all sequences, flattened in sequence order), S sequences.

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: absolute position of each new token in its sequence
    out_slots: torch.Tensor  # [T] int64: KV slot (page * page_size + offset) that receives each new token's row
    extend_lens: list[int]  # [S] new tokens per sequence (1 for a decode step)
    seq_lens: list[int]  # [S] KV length per sequence after this forward (cached prefix + new tokens)
    page_tables: list[torch.Tensor]  # [S] int64 page ids covering seq_lens[i] tokens, in order

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the absorbed (latent-space) attention applies."""
        return all(n == 1 for n in self.extend_lens)

    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True)]

    def last_token_index(self) -> torch.Tensor:
        """[S] index into the T new tokens of each sequence's last token (where logits are taken)."""
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0)
        return ends - 1
