"""Overlapped decode: step N+1 is launched (its input tokens gathered on the device from step N's samples)
before step N's tokens are read, so the host's per-step work runs while the GPU computes, as SGLang's overlap
scheduler and vLLM's async scheduling do. `Engine.step()` then reports each token one call later."""

# Only in its steady state: every running request decoding on a captured graph, none waiting, sampling the
# one-pass kernel does exactly (greedy or temperature; chosen-token logprobs, no top alternatives; no
# penalties, bias, min_tokens or grammar, which need each step's tokens on the host). The batch may change
# without leaving it: a request certain to end with its in-flight token is not fed again, an ended or aborted
# one drops out, one joining with its KV in place (PD add_prefilled) brings its last token from the host.
# Anything else (a prefill chunk, a waiting request, a preemption, an unsupported sampling feature) drains the
# in-flight step first. A request ending on a stop token while its next step is in flight had one extra KV
# row computed into its own pages: that token is dropped, and the pages are reused only by later work on the
# same stream.

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from libs.engine.batcher import pages_for
from libs.engine.outputs import StepOutput
from libs.engine.pages import OutOfPagesError
from libs.engine.request import Request
from libs.engine.runner import Chunk
from libs.engine.sampling import chosen_logprobs, one_pass_ok, one_pass_sample


@dataclass
class InFlight:
    reqs: list[Request]  # in batch order
    tokens: torch.Tensor  # [n] int64 on the device: what the step sampled
    host: torch.Tensor  # [n] int64 pinned: its copy, valid once `done` has passed
    done: torch.cuda.Event | _Done
    logprobs: torch.Tensor | None = None  # [n] float32 pinned: the chosen tokens' logprobs, where asked


class _Done:
    """The eager mode's event: its work ran as it was issued."""

    def synchronize(self) -> None:
        pass


class OverlapDecoder:
    """eager: the same host logic over eager forwards on any device instead of the captured graph (the CPU
    tests of the batch-change and page logic; the CUDA path is the graph one)."""

    def __init__(self, engine: Any, eager: bool = False) -> None:  # libs.engine.engine.Engine
        self.engine = engine
        self.eager = eager
        self.inflight: InFlight | None = None
        self.wait_s = 0.0  # the host's time blocked on the device in reads since the engine's step began

    def try_step(self) -> list[StepOutput] | None:
        """Launch the next decode step and report the previous one's tokens; None when the steady state
        does not hold (the caller drains and steps plainly)."""
        e, prev = self.engine, self.inflight
        self.wait_s = 0.0  # the engine's step begins here (a drain after it adds to this step's wait)
        if e.waiting or e._pending or not e.running:
            return None
        at = {id(r): i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        reqs: list[Request] = []  # the rows to launch, in batch order, and each one's input: its index in
        src: list[int] = []  # prev's sampled tokens, or -1 for its last token on the host (it joined)
        for r in e.running:
            if not one_pass_ok(r.params) or r.params.needs_processing:
                return None
            i = at.get(id(r), -1)
            ahead = 1 if i >= 0 else 0  # a token sampled but not read yet
            if r.num_computed != r.num_tokens - 1 + ahead:
                return None  # not a plain decode row (a prefill chunk is due)
            if len(r.output_ids) + ahead >= r.params.max_tokens:
                if ahead:
                    continue  # it ends with its in-flight token (read below): not fed again
                return None
            reqs.append(r)
            src.append(i)
        if not reqs:
            return None
        positions = [r.num_computed for r in reqs]
        if not self.eager and not e.runner.can_graph_decode(len(reqs), positions):
            return None
        need = [
            max(0, pages_for(p + 1, e.page_size) - len(r.pages)) for r, p in zip(reqs, positions, strict=True)
        ]
        if sum(need) > e._available_pages():  # free or evictable: a full pool's cache gives way here as in
            return None  # the plain step (pages it evicts are no in-flight request's: those are locked)
        try:
            for r, n in zip(reqs, need, strict=True):
                if n:
                    r.pages += e._alloc(n)
        except OutOfPagesError:  # the cache freed less than it counted (pages shared elsewhere): pages
            return None  # given so far stay with their requests, which need them next anyway
        tokens = [r.output_ids[-1] if i < 0 else 0 for r, i in zip(reqs, src, strict=True)]
        token_src = _inputs(prev, src, tokens)
        if self.eager:
            ids = token_src.tolist() if token_src is not None else tokens
            chunks = [Chunk([t], p, r.pages) for t, p, r in zip(ids, positions, reqs, strict=True)]
            logits = e.runner.forward_last(chunks)
        else:
            logits = e.runner.decode_graph(tokens, positions, [r.pages for r in reqs], token_src=token_src)
        if logits is None:  # graphs turned off (a capture failed): nothing was launched
            return None
        keys = [(r.seed, p + 1) for r, p in zip(reqs, positions, strict=True)]  # the sampled token's position
        sampled, lps = one_pass_sample(logits, [r.params for r in reqs], keys)
        host, host_lps = _to_host(sampled), (_to_host(lps) if lps is not None else None)
        done: torch.cuda.Event | _Done = _Done() if not sampled.is_cuda else torch.cuda.Event()
        if isinstance(done, torch.cuda.Event):
            done.record()
        for r in reqs:
            r.num_computed += 1
        self.inflight = InFlight(list(reqs), sampled, host, done, host_lps)
        return self._read(prev) if prev is not None else []

    def drain(self) -> list[StepOutput]:
        """Read the in-flight step, if any: afterwards every request is in the plain step's state."""
        prev, self.inflight = self.inflight, None
        return self._read(prev) if prev is not None else []

    def _read(self, step: InFlight) -> list[StepOutput]:
        e = self.engine
        t = time.perf_counter()
        step.done.synchronize()
        self.wait_s += time.perf_counter() - t
        outs = []
        tokens = step.host.tolist()
        lps = chosen_logprobs(tokens, step.logprobs, [r.params for r in step.reqs])
        for r, token, lp in zip(step.reqs, tokens, lps, strict=True):
            if e.requests.get(r.rid) is not r or r.finished:
                continue  # aborted, or ended by the token before this one: its extra token is dropped
            outs.append(e._accept(r, token, lp))
        return outs


def _inputs(prev: InFlight | None, src: list[int], tokens: list[int]) -> torch.Tensor | None:
    """The launched rows' input tokens on the device, or None when the host's `tokens` are all of them:
    prev's samples as they are when the batch is prev's, else gathered from them (rows that carried on) or
    taken from the host (rows that joined), without a host round trip."""
    if prev is None or all(i < 0 for i in src):
        return None
    if src == list(range(len(prev.reqs))):
        return prev.tokens
    n = len(src)
    meta = torch.tensor(tokens + src, dtype=torch.int64, pin_memory=prev.tokens.is_cuda).to(
        prev.tokens.device, non_blocking=True
    )
    host, idx = meta[:n], meta[n:]
    return torch.where(idx >= 0, prev.tokens.index_select(0, idx.clamp(min=0)), host)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host, started now: pinned and asynchronous from a GPU (valid once the step's event has
    passed), a plain copy elsewhere."""
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
