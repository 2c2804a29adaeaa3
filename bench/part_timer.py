"""Where a forward's time goes, by part, for benchmarks (bench.prefill_rank): the engine's own functions for
the MLA block, its attention kernel and the MoE block are wrapped, while attached, so that each call is
bracketed by CUDA events (by wall clock on the CPU, where work runs as it is issued); the model code is not
touched and nothing is synchronized inside a step. Sum per part after the step; "other" is the step's rest
(norms, embedding, head, sampling, the host's work between kernels). For eager forwards (prefill): a step
replayed from a CUDA graph runs none of these functions, and events recorded during a capture would break it.

    with PartTimer(engine) as parts:
        engine.step()
    parts.totals_ms()   # {"attention": .., "attention_kernel": .., "moe": ..}
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from libs.engine.layers import attention_backend, fast_path
from libs.engine.models import deepseek_v3

PARTS = ("attention", "attention_kernel", "moe")


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def places() -> dict[str, list[tuple[Any, str]]]:
    """part -> (owner, attribute): the MLA block on both the fast and the plain path, each attention backend's
    core kernel call (nested inside "attention"; backends loaded by the time a timer is entered), the MoE
    block (routing, the experts or the EP hook, the shared expert)."""
    backends = [c for c in _subclasses(attention_backend.AttentionBackend) if "attend" in vars(c)]
    return {
        "attention": [(fast_path, "attention"), (deepseek_v3.Attention, "forward")],
        "attention_kernel": [(c, "attend") for c in backends],
        "moe": [(fast_path, "moe"), (deepseek_v3.MoE, "forward")],
    }


class PartTimer:
    def __init__(self, cuda: bool | None = None) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.marks: list[tuple[str, Any, Any]] = []  # (part, start, end): events, or perf_counter seconds
        self._saved: list[tuple[Any, str, Any]] = []

    def _stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._stamp()
            out = fn(*args, **kwargs)
            self.marks.append((part, start, self._stamp()))
            return out

        return timed

    def __enter__(self) -> PartTimer:
        for part, where in places().items():
            for owner, name in where:
                fn = getattr(owner, name)
                self._saved.append((owner, name, fn))
                setattr(owner, name, self._wrap(part, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per part over everything timed so far (synchronizes on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(PARTS, 0.0)
        for part, start, end in self.marks:
            out[part] += start.elapsed_time(end) if self.cuda else 1000 * (end - start)
        return out


def breakdown(step: Callable[[], object], cuda: bool | None = None) -> dict[str, float]:
    """Run `step` once under a PartTimer: ms per part, the step's own ms, and `other_ms` (step - attention -
    moe), each with its share of the step."""
    timer = PartTimer(cuda)
    with timer:
        start = timer._stamp()
        step()
        end = timer._stamp()
    parts = timer.totals_ms()
    total = start.elapsed_time(end) if timer.cuda else 1000 * (end - start)
    rec = {f"{p}_ms": v for p, v in parts.items()} | {"step_ms": total}
    rec["other_ms"] = total - parts["attention"] - parts["moe"]
    rec |= {f"{p}_share": v / total for p, v in [*parts.items(), ("other", rec["other_ms"])] if total > 0}
    return rec
