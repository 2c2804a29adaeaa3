"""Logits processing before sampling: structured output, min_tokens, logit_bias and the three penalties.

The engine calls one `LogitsProcessors` per step: `add` when a request is created, `apply` on the batch's
logits right before `sample`, `accept` with the sampled tokens, `remove` when the request ends. Requests
that use none of these never enter it, and a batch with no such request costs one dict check.

Semantics are vLLM's (v1 sampler and `apply_penalties`), applied in vLLM's order:
1. structured output: the grammar's token bitmask, filled on the host by xgrammar (while the forward
   runs on the GPU, as kernel launches are asynchronous) and applied on the device (-inf where not allowed);
2. min_tokens: the stop token ids and EOS (unless ignore_eos) are -inf while fewer than min_tokens
   output tokens exist;
3. logit_bias: added to the logits by token id;
4. repetition_penalty over prompt + output tokens (positive logits divided, negative multiplied),
   then frequency_penalty * count and presence_penalty * [count > 0] subtracted, over output tokens only.

Penalty state lives on the device, one row per penalized request in a slot table: `counts[slot]` (output
token counts) and `seen[slot]` (prompt or output token), updated in place by one scatter per step, never
rebuilt from the history.

Legend: S rows (sequences) of the logits, P penalized rows, G grammar rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from libs.engine.processing_params import (  # noqa: F401  (GuidedSpec, choice_grammar re-exported)
    MAX_LOGIT_BIAS,
    GuidedSpec,
    choice_grammar,
    needs_processing,
    uses_penalties,
    validate_processing,
)
from libs.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from libs.tokenizer import Tokenizer

class Seq(Protocol):
    """What the processors read of an engine request."""

    rid: str
    output_ids: list[int]


@dataclass
class _State:
    params: SamplingParams
    stop_ids: list[int]  # masked while under min_tokens
    bias_ids: list[int]
    bias_vals: list[float]
    slot: int = -1  # penalty row, -1 without penalties
    matcher: Any = None  # xgrammar.GrammarMatcher


class LogitsProcessors:
    """Per-engine processing state; every method runs on the thread that drives the engine."""

    def __init__(
        self, vocab_size: int, device: torch.device | str, eos_ids: Sequence[int], tokenizer: Tokenizer | None
    ) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.eos_ids, self.tokenizer = list(eos_ids), tokenizer
        self.states: dict[str, _State] = {}
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=self.device)  # [C, V]
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)  # [C, V]
        self._free_slots: list[int] = []
        self._grammars: Any = None  # libs.engine.grammar.GrammarBackend, built on first use

    def add(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Register a request (no-op unless it needs processing). ValueError on a bad grammar or bias id."""
        if not needs_processing(params):
            return
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}")
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_ids)
        bias = [(t, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v)))) for t, v in params.logit_bias]
        state = _State(params, stop_ids, [t for t, _ in bias], [v for _, v in bias])
        if params.guided is not None:
            state.matcher = self._grammar_backend().matcher(params.guided)
        if uses_penalties(params):
            state.slot = self._take_slot()
            ids = torch.tensor([t for t in prompt_ids if 0 <= t < self.vocab_size], dtype=torch.long)
            self.seen[state.slot, ids.to(self.device)] = True
        self.states[rid] = state

    def remove(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None and state.slot >= 0:
            self._free_slots.append(state.slot)

    def apply(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        """[S, V] logits for seqs (row i is seqs[i]) -> processed logits: the input itself when no row
        needs processing, else a processed copy (the input stays raw for logprobs)."""
        if not self.states:
            return logits
        rows = [(i, st) for i, s in enumerate(seqs) if (st := self.states.get(s.rid)) is not None]
        if not rows:
            return logits
        mask = self._grammar_mask(rows)  # host work first: it overlaps the forward still running
        out = logits.float().clone()
        if mask is not None:
            out[mask[0]] = out[mask[0]].masked_fill(~mask[1], float("-inf"))
        self._min_tokens(out, rows, seqs)
        self._logit_bias(out, rows)
        self._penalties(out, rows)
        return out

    def accept(self, seqs: Sequence[Seq], tokens: Sequence[int]) -> None:
        """Record each row's sampled token (counts, grammar state). ValueError if a grammar refuses it."""
        if not self.states:
            return
        slots, toks = [], []
        for s, tok in zip(seqs, tokens, strict=True):
            st = self.states.get(s.rid)
            if st is None:
                continue
            if st.matcher is not None and not st.matcher.is_terminated() and not st.matcher.accept_token(tok):
                raise ValueError(f"token {tok} does not follow the request's structured-output grammar")
            if st.slot >= 0 and 0 <= tok < self.vocab_size:
                slots.append(st.slot)
                toks.append(tok)
        if slots:
            idx = (torch.tensor(slots, device=self.device), torch.tensor(toks, device=self.device))
            self.counts.index_put_(idx, torch.ones(len(slots), device=self.device), accumulate=True)
            self.seen[idx] = True

    # --- internals ---
    def _take_slot(self) -> int:
        if not self._free_slots:
            old = self.counts.shape[0]
            new = max(8, 2 * old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(new - old, self.vocab_size)])
            self._free_slots = list(range(new - 1, old - 1, -1))
        slot = self._free_slots.pop()
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        return slot

    def _grammar_backend(self) -> Any:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the checkpoint's tokenizer (tokenizer.json)")
            from libs.engine.grammar import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars

    def _grammar_mask(self, rows: list[tuple[int, _State]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices [G], allowed [G, V] on the device) for the rows under a grammar."""
        gram = [(i, st.matcher) for i, st in rows if st.matcher is not None]
        if not gram:
            return None
        bitmask = self._grammar_backend().fill_bitmask([mt for _, mt in gram])  # [G, ceil(V/32)] int32
        return (
            torch.tensor([i for i, _ in gram], device=self.device),
            unpack_bitmask(bitmask.to(self.device, non_blocking=True), self.vocab_size),
        )

    def _min_tokens(self, out: torch.Tensor, rows: list[tuple[int, _State]], seqs: Sequence[Seq]) -> None:
        r, t = [], []
        for i, st in rows:
            if len(seqs[i].output_ids) < st.params.min_tokens:
                ids = [x for x in st.stop_ids if 0 <= x < self.vocab_size]
                r += [i] * len(ids)
                t += ids
        if r:
            out[torch.tensor(r, device=out.device), torch.tensor(t, device=out.device)] = float("-inf")

    def _logit_bias(self, out: torch.Tensor, rows: list[tuple[int, _State]]) -> None:
        r, t, v = [], [], []
        for i, st in rows:
            r += [i] * len(st.bias_ids)
            t += st.bias_ids
            v += st.bias_vals
        if r:
            dev = out.device
            idx = (torch.tensor(r, device=dev), torch.tensor(t, device=dev))
            out.index_put_(idx, torch.tensor(v, dtype=out.dtype, device=dev), accumulate=True)

    def _penalties(self, out: torch.Tensor, rows: list[tuple[int, _State]]) -> None:
        pen = [(i, st) for i, st in rows if st.slot >= 0]
        if not pen:
            return
        dev = out.device
        idx = torch.tensor([i for i, _ in pen], device=dev)
        slots = torch.tensor([st.slot for _, st in pen], device=dev)
        rep, freq, pres = (
            torch.tensor([getattr(st.params, f) for _, st in pen], dtype=out.dtype, device=dev).unsqueeze(1)
            for f in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        )
        sub, counts = out[idx], self.counts[slots]  # [P, V]
        scale = torch.where(sub > 0, 1.0 / rep, rep)
        sub = torch.where(self.seen[slots], sub * scale, sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        out[idx] = sub


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [G, ceil(V/32)] (bit j of word w allows token 32w + j) -> bool [G, V]."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
