"""How long a worker's forward pass takes, as a pure function of what it runs (the timing-model engine's clock):
a decode step of B sequences with C context tokens costs `fixed + per_seq * B + per_ctx * C` ms; a prefill
of T new tokens `prefill_fixed + prefill_per_token * T` ms."""

# The decode terms: attention grows with the KV read (C), the GEMMs and host work with the batch, launch and
# sync costs are fixed. `fit_decode` fits them by least squares to bench/decode_rank records; `H200_DECODE`
# is the fit of the committed record below (a unit test re-fits it). No prefill record is committed, so the
# prefill terms are settings.

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class DecodeFit:
    fixed_ms: float
    per_seq_ms: float
    per_ctx_token_ms: float

    def step_ms(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.fixed_ms + self.per_seq_ms * batch + self.per_ctx_token_ms * context_tokens


# fit_decode(load_records(["bench/results/decode_rank-w1-flashinfer-block-rowwise-20261130T224016.json"]))
H200_DECODE = DecodeFit(fixed_ms=9.333, per_seq_ms=0.08685, per_ctx_token_ms=3.636e-05)
H200_DECODE_RECORD = "bench/results/decode_rank-w1-flashinfer-block-rowwise-20261130T224016.json"


@dataclass(frozen=True)
class StepTimeModel:
    decode: DecodeFit = H200_DECODE
    prefill_fixed_ms: float = 5.0
    prefill_per_token_ms: float = 0.04
    speed: float = 1.0  # > 1 runs the modeled GPU that many times faster (every wait divided by it)

    def __post_init__(self) -> None:
        if self.speed <= 0 or self.prefill_fixed_ms < 0 or self.prefill_per_token_ms < 0:
            raise ValueError(f"step-time model needs speed > 0 and non-negative prefill costs: {self}")

    def forward_ms(self, new_tokens: Sequence[int], seq_lens: Sequence[int]) -> float:
        """One forward over chunks with these new-token counts and lengths after them: a decode step when
        every chunk brings one token, else a prefill of all the new tokens."""
        if not new_tokens:
            return 0.0
        if all(n == 1 for n in new_tokens):
            ms = self.decode.step_ms(len(new_tokens), sum(seq_lens))
        else:
            ms = self.prefill_fixed_ms + self.prefill_per_token_ms * sum(new_tokens)
        return ms / self.speed


def load_records(paths: Iterable[str | Path]) -> list[dict]:
    """The decode_rank rows (step_ms, attention_ms, batch, ctx) of these JSON files."""
    rows: list[dict] = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        for r in data if isinstance(data, list) else [data]:
            if r.get("benchmark") == "decode_rank" and "step_ms" in r and "attention_ms" in r:
                rows.append(r)
    if not rows:
        raise ValueError(f"no decode_rank records with step_ms and attention_ms in {list(paths)}")
    return rows


def fit_decode(rows: Sequence[dict]) -> DecodeFit:
    """Least squares: attention_ms ~ per_ctx * (batch * ctx); step_ms - attention_ms ~ fixed + per_seq * batch."""
    batch = np.array([r["batch"] for r in rows], dtype=np.float64)
    ctx = batch * np.array([r["ctx"] for r in rows], dtype=np.float64)
    attn = np.array([r["attention_ms"] for r in rows], dtype=np.float64)
    rest = np.array([r["step_ms"] for r in rows], dtype=np.float64) - attn
    if len(set(batch.tolist())) < 2:
        raise ValueError("fitting the batch term needs records at two batch sizes at least")
    per_ctx = float(ctx @ attn / (ctx @ ctx))
    a = np.stack([np.ones_like(batch), batch], axis=1)
    (fixed, per_seq), *_ = np.linalg.lstsq(a, rest, rcond=None)
    return DecodeFit(float(fixed), float(per_seq), per_ctx)
