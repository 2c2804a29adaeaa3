"""Logits processing before sampling, with vLLM's semantics and order: structured output, min_tokens,
logit_bias, then repetition, frequency and presence penalties. The engine calls `add` per new request, `apply`
on the logits before `sample`, `accept` with the sampled tokens, `remove` when the request ends."""

# Legend: S rows (sequences) of the logits, P penalized rows, G grammar rows, V vocabulary.
# Structured output: xgrammar fills the bitmask on the host while the forward runs, applied on the device.
# A grammar with `start_after` (a reasoning model's end-of-thinking ids) waits until the output has emitted
# them: the reasoning is free, the answer after it is constrained.
# min_tokens: stop ids and EOS (unless ignore_eos) are -inf until min_tokens outputs exist. Penalties:
# repetition over prompt + output (positive logits divided, negative multiplied), then frequency * count
# and presence * [count > 0] over output only. Requests that use none of these never enter, and a batch
# without any costs one dict check. Penalty state lives on the device, a row per penalized request
# (`counts`, `seen`), updated by one scatter per step, never rebuilt. A batch's index and parameter tensors
# (a `_Plan`) go to the device in two non-blocking copies and are kept while the batch stays the same, so a
# steady step builds nothing on the host but its key and nothing waits for the device (bench/sampler_cost.py).

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
    stop_ids: list[int]  # masked while under min_tokens (ids inside the vocabulary)
    bias_ids: list[int]
    bias_vals: list[float]
    slot: int = -1  # penalty row, -1 without penalties
    matcher: Any = None  # xgrammar.GrammarMatcher
    gate: tuple[int, ...] = ()  # the grammar starts after the output ends with these ids
    gate_open: bool = True

    @property
    def grammar_on(self) -> bool:
        return self.matcher is not None and self.gate_open


@dataclass
class _Plan:
    """A batch's processing as device tensors: flat (row * V + token) indices, penalty rows and parameters."""

    key: tuple
    min_idx: torch.Tensor  # [M] int64: stop ids of rows under min_tokens
    bias_idx: torch.Tensor  # [N] int64
    bias_vals: torch.Tensor  # [N] float32
    pen_rows: torch.Tensor  # [P] int64 rows of the logits
    pen_slots: torch.Tensor  # [P] int64 rows of the count table
    pen_params: torch.Tensor  # [3, P] float32: repetition, frequency, presence
    grammar_rows: list[int]


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
        self._plan: _Plan | None = None  # the last batch's, dropped whenever a request comes or goes
        self._ones = torch.ones(0, device=self.device)
        self._host_bitmasks = HostBitmasks(vocab_size, pin=self.device.type == "cuda")

    def add(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Register a request (no-op unless it needs processing). ValueError on a bad grammar or bias id."""
        if not needs_processing(params):
            return
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}"
            )
        stop_ids = [t for t in list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_ids)
                    if 0 <= t < self.vocab_size]  # fmt: skip
        bias = [(t, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v)))) for t, v in params.logit_bias]
        state = _State(params, stop_ids, [t for t, _ in bias], [v for _, v in bias])
        if params.guided is not None:
            state.matcher = self._grammar_backend().matcher(params.guided)
            state.gate = params.guided.start_after
            state.gate_open = not state.gate
        if uses_penalties(params):
            state.slot = self._take_slot()
            ids = torch.tensor([t for t in prompt_ids if 0 <= t < self.vocab_size], dtype=torch.long)
            self.seen[state.slot].index_fill_(0, ids.to(self.device, non_blocking=True), True)
        self.states[rid] = state
        self._plan = None

    def remove(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None:
            self._plan = None
            if state.slot >= 0:
                self._free_slots.append(state.slot)

    def apply(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        """[S, V] logits for seqs (row i is seqs[i]) -> processed float32 logits: the input itself when no row
        needs processing, else a processed copy (the input stays raw for logprobs)."""
        if not self.states:
            return logits
        rows = [(i, st) for i, s in enumerate(seqs) if (st := self.states.get(s.rid)) is not None]
        if not rows:
            return logits
        plan = self._plan_for(rows, seqs)
        bitmask = self._fill_bitmask(rows)  # host work first: it overlaps the forward still running
        # the one [S, V] cast (a copy: the raw logits stay for logprobs)
        out = (logits.float() if logits.dtype != torch.float32 else logits.clone()).contiguous()
        if bitmask is not None:
            device_bitmask = bitmask.to(out.device, non_blocking=True)
            self._host_bitmasks.copied()
            apply_bitmask(out, device_bitmask, plan.grammar_rows, self.vocab_size)
        flat = out.view(-1)
        if plan.min_idx.numel():
            flat.index_fill_(0, plan.min_idx, float("-inf"))
        if plan.bias_idx.numel():
            flat.index_add_(0, plan.bias_idx, plan.bias_vals)
        if plan.pen_rows.numel():
            args = (out, plan.pen_rows, plan.pen_slots, self.counts, self.seen, *plan.pen_params)
            if out.is_cuda:
                from libs.kernels.penalties import apply_penalties

                apply_penalties(*args)
            else:
                penalties_torch(*args)
        return out

    def accept(self, seqs: Sequence[Seq], tokens: Sequence[int]) -> None:
        """Record each row's sampled token (counts, grammar state). ValueError if a grammar refuses it."""
        if not self.states:
            return
        flat = []
        for s, tok in zip(seqs, tokens, strict=True):
            st = self.states.get(s.rid)
            if st is None:
                continue
            if st.matcher is not None and not st.gate_open:
                st.gate_open = _ends_with(s.output_ids, tok, st.gate)
                self._plan = None if st.gate_open else self._plan  # its rows change: a new plan
            elif st.matcher is not None and not st.matcher.is_terminated() and not st.matcher.accept_token(tok):
                raise ValueError(f"token {tok} does not follow the request's structured-output grammar")
            if st.slot >= 0 and 0 <= tok < self.vocab_size:
                flat.append(st.slot * self.vocab_size + tok)
        if flat:
            idx = torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True)
            if self._ones.numel() < len(flat):
                self._ones = torch.ones(2 * len(flat), device=self.device)
            self.counts.view(-1).index_add_(0, idx, self._ones[: len(flat)])
            self.seen.view(-1).index_fill_(0, idx, True)

    # --- internals ---
    def _plan_for(self, rows: list[tuple[int, _State]], seqs: Sequence[Seq]) -> _Plan:
        """The last plan while the batch's processed requests (and which are under min_tokens) are the same."""
        under = [len(seqs[i].output_ids) < st.params.min_tokens for i, st in rows]
        key = (len(seqs), tuple((i, seqs[i].rid, u) for (i, _), u in zip(rows, under, strict=True)))
        if self._plan is not None and self._plan.key == key:
            return self._plan
        v = self.vocab_size
        min_idx: list[int] = []
        bias_idx: list[int] = []
        bias_vals: list[float] = []
        pen: list[tuple[int, int, SamplingParams]] = []
        for (i, st), under_min in zip(rows, under, strict=True):
            if under_min:
                min_idx += [i * v + t for t in st.stop_ids]
            bias_idx += [i * v + t for t in st.bias_ids]
            bias_vals += st.bias_vals
            if st.slot >= 0:
                pen.append((i, st.slot, st.params))
        ints = torch.tensor(
            min_idx + bias_idx + [i for i, _, _ in pen] + [s for _, s, _ in pen], dtype=torch.long
        )
        floats = torch.tensor(
            bias_vals + [float(getattr(sp, f)) for f in _PENALTIES for _, _, sp in pen], dtype=torch.float32
        )
        ints, floats = (t.to(self.device, non_blocking=True) for t in (ints, floats))
        m, n, p = len(min_idx), len(bias_idx), len(pen)
        self._plan = _Plan(
            key, ints[:m], ints[m : m + n], floats[:n], ints[m + n : m + n + p], ints[m + n + p :],
            floats[n:].view(3, p), [i for i, st in rows if st.grammar_on],
        )  # fmt: skip
        return self._plan

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

    def _fill_bitmask(self, rows: list[tuple[int, _State]]) -> torch.Tensor | None:
        """The host bitmask [G, ceil(V/32)] int32 of the rows under a grammar, in row order."""
        matchers = [st.matcher for _, st in rows if st.grammar_on]
        if not matchers:
            return None
        return self._grammar_backend().fill_bitmask(matchers, out=self._host_bitmasks.take(len(matchers)))


def _ends_with(output_ids: Sequence[int], tok: int, gate: tuple[int, ...]) -> bool:
    """Whether output_ids + [tok] ends with gate."""
    if not gate or gate[-1] != tok:
        return False
    head = gate[:-1]
    return not head or tuple(output_ids[-len(head) :]) == head


class HostBitmasks:
    """Two host buffers the grammar fills in turn; pinned (CUDA), so a bitmask's copy to the device runs
    asynchronously instead of staging 4 MB (B=256, V=129,280) through pageable memory on the host. A buffer
    is refilled only once the copy that read it, two steps back, has finished (in practice it has)."""

    def __init__(self, vocab_size: int, pin: bool) -> None:
        self.words, self.pin = (vocab_size + 31) // 32, pin
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.done: list[Any] = [None, None]  # torch.cuda.Event after the copy that read the buffer
        self.turn = 0

    def take(self, rows: int) -> torch.Tensor:
        """The next buffer, [rows, words] int32 (grown to 2x when too small), no longer read by a copy."""
        self.turn ^= 1
        if self.done[self.turn] is not None:
            self.done[self.turn].synchronize()
            self.done[self.turn] = None
        buf = self.bufs[self.turn]
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(max(8, 2 * rows), self.words, dtype=torch.int32)
            self.bufs[self.turn] = buf = buf.pin_memory() if self.pin else buf
        return buf[:rows]

    def copied(self) -> None:
        """Called once the copy of the buffer `take` gave last is queued on the current stream."""
        if self.pin:
            self.done[self.turn] = torch.cuda.Event()
            self.done[self.turn].record()


_PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def apply_bitmask(out: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """-inf in place where the packed bitmask [G, W] (row g for out's row rows[g]) disallows a token: xgrammar's
    kernel (Triton on CUDA, C++ on the CPU) on the packed words, or unpacked in torch without xgrammar."""
    s = out.shape[0]
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        idx = torch.tensor(rows).to(out.device, non_blocking=True)
        out[idx] = out[idx].masked_fill(~unpack_bitmask(bitmask, vocab_size), float("-inf"))
        return
    if rows == list(range(s)):
        apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab_size)
        return
    full = torch.full((s, bitmask.shape[1]), -1, dtype=torch.int32, device=out.device)  # xgrammar reads row i
    full[torch.tensor(rows).to(out.device, non_blocking=True)] = bitmask  # of the bitmask for logits row i
    apply_token_bitmask_inplace(out, full, vocab_size=vocab_size, indices=rows)


def penalties_torch(out, rows, slots, counts, seen, rep, freq, pres) -> None:
    """libs.kernels.penalties.apply_penalties (same arguments) as torch ops: the CPU's path."""
    x, c = out[rows], counts[slots]  # [P, V]
    r = torch.where(seen[slots], rep[:, None], 1.0)
    x = torch.where(x > 0, x / r, x * r)
    x -= freq[:, None] * c
    x -= pres[:, None] * (c > 0)
    out[rows] = x


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [G, ceil(V/32)] (bit j of word w allows token 32w + j) -> bool [G, V]."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
