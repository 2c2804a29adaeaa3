"""`KvStream`: one prompt's KV written into its decode handle chunk by chunk, while the prompt still computes."""

# Per chunk, not per layer. After every batched step the prefill loop reads which of a prompt's pages are
# final (all their rows computed; later chunks write only past them) and the stream writes those at once, off
# the engine thread, while the next chunk computes; once the last chunk has run only the pages since then
# are left to send. Why per chunk: the step boundary already exists (and on CUDA one event after the step
# fences every layer), each write carries every layer of the new pages as one batch of merged runs, and
# everything but the last chunk's KV leaves the critical path, which is where a long prompt's transfer time
# lies. Per layer would need a hook and a CUDA event inside the model's forward for each of 61 layers and pay
# Mooncake's per-batch cost 61 times per chunk, to also hide the last chunk's transfer, which is at most one
# chunk's KV. SGLang's Mooncake backend likewise sends KV per chunk. A prompt that fits one chunk still
# overlaps with the rest of its batch (its result comes back as soon as its step returns).
#
# Order and safety: one write at a time per prompt, in order. A page goes again whenever the source page at
# its index changed, and after a preemption (the loop reports [] pages) every page goes again, so the decode
# side ends with exactly the prompt's final pages. Every write first passes `check` (lease margin, cancel);
# a failed write fails the prompt at once (`on_error`), and `close` waits for a write in flight, so the
# caller tells the decode side to free its pages only once nothing can land in them any more.

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from services.prefill_worker.prefill_loop import Fence

# (source pages, destination pages) -> (bytes written, runs); blocking, run in a thread
WriteFn = Callable[[list[int], list[int]], tuple[int, int]]


def pages_due(final: Sequence[int], sent: Mapping[int, int], skip: int) -> list[int]:
    """Indices (skip on) of the prompt's final pages the decode side lacks: never sent, or sent from
    another source page."""
    return [i for i in range(skip, len(final)) if sent.get(i) != final[i]]


class KvStream:
    def __init__(
        self,
        write: WriteFn,
        dst_pages: Sequence[int],
        skip: int,
        check: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """Page i of the prompt goes into dst_pages[i - skip]; pages before `skip` the decode side caches."""
        self._write_fn, self._dst, self._skip = write, list(dst_pages), skip
        self._check, self._on_error = check, on_error
        self._sent: dict[int, int] = {}  # prompt page index -> source page that landed there
        self._epoch = 0  # bumped by a preemption: writes of an older epoch do not count as sent
        self._final: list[int] = []
        self._fence: Fence | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.bytes = self.early_bytes = self.runs = 0
        self.seconds = 0.0  # time spent in writes (early ones overlap compute)

    def update(self, final: list[int], fence: Fence | None) -> None:
        """The prompt's final pages so far (PrefillLoop watcher, on the event loop)."""
        if self._closed or self._error is not None:
            return
        if not final:  # preempted: its rows may be recomputed into other pages
            self._sent.clear()
            self._epoch += 1
        self._final, self._fence = list(final), fence
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._pump(), name="kv-stream")

    async def _pump(self) -> None:
        try:
            while not self._closed and (due := pages_due(self._final, self._sent, self._skip)):
                self.early_bytes += await self._write(due, self._final, self._fence)
        except Exception as e:
            self._error = e
            self._on_error(e)

    async def _write(self, due: list[int], final: list[int], fence: Fence | None) -> int:
        self._check()
        src, dst = [final[i] for i in due], [self._dst[i - self._skip] for i in due]
        epoch = self._epoch

        def run() -> tuple[int, int]:
            if fence is not None:
                fence()
            return self._write_fn(src, dst)

        t0 = time.perf_counter()
        nbytes, runs = await asyncio.to_thread(run)
        self.seconds += time.perf_counter() - t0
        self.bytes, self.runs = self.bytes + nbytes, self.runs + runs
        if epoch == self._epoch:
            self._sent.update((i, final[i]) for i in due)
        return nbytes

    async def finish(self, pages: list[int]) -> int:
        """After the prompt's last chunk: wait for the write in flight, then write every page not yet on
        the decode side (`pages` is the whole prompt); returns the bytes written after the last chunk."""
        if self._task is not None:
            await asyncio.wait({self._task})
        if self._error is not None:
            raise self._error
        self._closed = True
        due = pages_due(pages, self._sent, self._skip)
        return await self._write(due, pages, None) if due else 0

    async def close(self) -> None:
        """No more writes; returns once none is in flight."""
        self._closed = True
        if self._task is not None:
            await asyncio.wait({self._task})
