"""A scripted double of the scheduler + decode worker, on a real NATS server."""

# It answers SCHED_SUBMIT like a scheduler and then, like a decode worker, publishes TokenBatch /
# RequestError messages to the Submit's stream subject. Each test picks a behaviour (`mode`). Every
# Submit and Cancel it sees is recorded; `wait_cancel` waits on the Cancel itself, not on time.

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from libs.bus import Bus
from libs.tokenizer import Tokenizer
from proto import subjects
from proto.messages import (
    Cancel,
    FinishReason,
    RequestError,
    Submit,
    SubmitReply,
    TokenBatch,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)

TEXT = " The model reads a prompt, one token at a time, and writes the next token. 日本語 ok."


def logprob_of(token_id: int, k: int, top_n: int, vocab: int) -> TokenLogprob:
    """Deterministic logprobs the tests can recompute: position k, token id."""
    lp = -0.125 * (k + 1)
    top = [TopLogprob(token_id, lp)] + [TopLogprob((token_id + j) % vocab, lp - j) for j in range(1, top_n)]
    return TokenLogprob(token_id, lp, top[:top_n])


@dataclass
class FakeMesh:
    bus: Bus
    tokenizer: Tokenizer
    # "tokens": admit, stream the script then EOS (or max_tokens); "forever": admit, stream until
    # cancelled, ignoring max_tokens (a worker that never finishes on its own); "refuse": reply
    # (code, message); "silent": never reply; "error": admit, stream `error_after` tokens then RequestError
    mode: str = "tokens"
    refuse: tuple[int, str] = (429, "queue full (2 waiting)")
    error_after: int = 2
    per_step: int = 2  # tokens per TokenBatch (coalescing)
    cached_tokens: int = 3
    admit_first: int | None = None  # "tokens"/"forever": admit this many submits, refuse the rest
    text: str = TEXT  # what "tokens" mode streams
    ids: list[int] | None = None  # token ids to stream instead of the text's (say, ids past the tokenizer's vocab)
    submits: list[Submit] = field(default_factory=list)
    cancels: dict[str, Cancel] = field(default_factory=dict)
    _cancel_seen: asyncio.Condition = field(default_factory=asyncio.Condition)
    _submit_seen: asyncio.Condition = field(default_factory=asyncio.Condition)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def start(self) -> None:
        await self.bus.subscribe(subjects.SCHED_SUBMIT, Submit, self._on_submit, concurrent=True)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel)
        await self.bus.flush()

    def script(self) -> list[int]:
        return self.ids if self.ids is not None else self.tokenizer.encode(self.text, add_special_tokens=False)

    async def _on_submit(self, s: Submit) -> SubmitReply | None:
        async with self._submit_seen:
            self.submits.append(s)
            position = len(self.submits)
            self._submit_seen.notify_all()
        if self.mode == "silent":
            return None
        if self.mode == "refuse" or (self.admit_first is not None and position > self.admit_first):
            return SubmitReply(request_id=s.request_id, ok=False, code=self.refuse[0], message=self.refuse[1])
        task = asyncio.get_running_loop().create_task(self._stream(s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return SubmitReply(request_id=s.request_id, ok=True)

    async def _on_cancel(self, c: Cancel) -> None:
        async with self._cancel_seen:
            self.cancels[c.request_id] = c
            self._cancel_seen.notify_all()

    async def wait_submits(self, n: int, timeout: float = 5.0) -> list[Submit]:
        async with asyncio.timeout(timeout), self._submit_seen:
            await self._submit_seen.wait_for(lambda: len(self.submits) >= n)
        return self.submits

    async def wait_cancel(self, request_id: str, timeout: float = 5.0) -> Cancel:
        async with asyncio.timeout(timeout), self._cancel_seen:
            await self._cancel_seen.wait_for(lambda: request_id in self.cancels)
        return self.cancels[request_id]

    async def _stream(self, s: Submit) -> None:
        await asyncio.sleep(0)  # let the reply go out first, as a scheduler's would
        eos = self.tokenizer.eos_token_id
        script = self.script() + ([eos] if self.mode == "tokens" else [])
        sp = s.sampling
        limit = 1 << 30 if self.mode == "forever" else s.sampling.max_tokens
        k = 0
        while k < limit:
            if s.request_id in self.cancels:
                return
            if self.mode == "error" and k >= self.error_after:
                await self._publish(
                    s, RequestError(request_id=s.request_id, code=503, message="decode worker d0 died")
                )
                return
            ids = [script[(k + j) % len(script)] for j in range(min(self.per_step, limit - k))]
            if eos in ids:  # "tokens" mode: the script ends with EOS
                ids = ids[: ids.index(eos) + 1]
            lps = (
                [logprob_of(t, k + j, sp.top_logprobs, 1024) for j, t in enumerate(ids)]
                if sp.logprobs
                else []
            )
            k += len(ids)
            stopped = ids[-1] == eos
            final = stopped or k >= limit
            delta = TokenDelta(
                s.request_id, ids, lps,
                finish=(FinishReason.STOP if stopped else FinishReason.LENGTH) if final else FinishReason.NONE,
                prompt_tokens=len(s.prompt_ids) if final else 0,
                completion_tokens=k if final else 0,
                cached_tokens=self.cached_tokens if final else 0,
            )  # fmt: skip
            await self._publish(s, TokenBatch(deltas=[delta]))
            if final:
                return
            if self.mode == "forever":
                await asyncio.sleep(0.002)  # a decode step's pace, so a client can read and leave

    async def _publish(self, s: Submit, msg: TokenBatch | RequestError) -> None:
        await self.bus.publish(s.stream_subject, msg)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
