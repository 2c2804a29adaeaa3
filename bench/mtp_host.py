"""The host side of one MTP speculative step, measured on CPU (`python -m bench.mtp --host`): what
`MTPEngine.step()` spends outside its forwards, and how many tensor values it reads on the host (each a
device sync on a GPU).

The engine runs the GPU's path: paged (Triton-backend) decode rows for verify and draft, replayed from
"graphs" (libs/engine/spec_graphs.py's RowGraphRunner with its capture replaced by `HostRowRunner`: a
replay reruns the captured body eagerly into the same static outputs, so packing the rows, planning and
replaying are the GPU path's host code). Per (B, k), B greedy requests decode on the demo model (or a
random tiny model), ignore_eos:

- `step_ms`: median `step()` wall time; `device_ms`: the part inside forwards (graph replays, eager
  target / MTP forwards, both heads: what a GPU runs); `host_ms` = step_ms - device_ms (median of the
  per-step differences): scheduling, row packing, acceptance, stop checks, draft bookkeeping;
- `host_cpu_ms`: the same split in this thread's CPU time (steadier than wall time on a shared machine;
  torch runs one thread here);
- `host_reads_per_step`: tensor values read on the host outside forwards (`tolist`, `item`, `bool`,
  `int`, `float` of a tensor): on a GPU each waits for the device (a sync).

The plain Engine's decode step (k 0) is the reference. CPU numbers are relative: the GPU's host runs the
same Python, faster per op.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from libs.engine import Engine, SamplingParams
from libs.engine.cuda_graph import capture_sizes
from libs.engine.spec_graphs import RowGraphRunner, _Graph
from libs.engine.speculative import MTPEngine


class Clock:
    """Wall time inside the timed calls (outermost only) and host reads of tensor values outside them."""

    def __init__(self) -> None:
        self.depth, self.device_s, self.device_cpu_s, self.reads = 0, 0.0, 0.0, 0

    def timed(self, fn: Callable) -> Callable:
        def wrapper(*a, **kw):
            if self.depth:
                return fn(*a, **kw)
            self.depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.device_s += time.perf_counter() - t0
                self.device_cpu_s += time.thread_time() - c0
                self.depth -= 1

        return wrapper

    @contextlib.contextmanager
    def counting_reads(self) -> Iterator[None]:
        names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
        saved = {n: getattr(torch.Tensor, n) for n in names}

        def counted(orig):
            def read(t, *a, **kw):
                if not self.depth:
                    self.reads += 1
                return orig(t, *a, **kw)

            return read

        for n, orig in saved.items():
            setattr(torch.Tensor, n, counted(orig))
        try:
            yield
        finally:
            for n, orig in saved.items():
                setattr(torch.Tensor, n, orig)


class _Replay:
    """A CPU stand-in for a captured graph: replay() reruns the step into the captured outputs."""

    def __init__(self, step: Callable[[], tuple[torch.Tensor, ...]], clock: Clock) -> None:
        with torch.inference_mode():
            self.step, self.outputs = step, step()
        self.replay = clock.timed(self._replay)

    @torch.inference_mode()
    def _replay(self) -> None:
        for out, new in zip(self.outputs, self.step(), strict=True):
            out.copy_(new)


class _NoEvent:
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class HostRowRunner(RowGraphRunner):
    """RowGraphRunner whose "capture" is `_Replay` on the model's (CPU) device."""

    clock: Clock

    def _capture(self, b: int) -> _Graph:
        g, step = self._inputs(b, pin=False, copied=_NoEvent())
        replay = self.clock.timed(_Replay)(step, self.clock)  # the capture: device work, as on a GPU
        g.graph, g.outputs = replay, replay.outputs  # type: ignore[assignment]
        self._graphs[b] = g
        return g


def host_graphs(engine: MTPEngine, clock: Clock, max_len: int) -> None:
    """Give a CPU MTPEngine on the Triton backend verify and draft "graphs" (HostRowRunner) over tables of
    max_len tokens (the CPU kernels' cost follows the table width), over a scratch page from its allocator."""
    scratch = engine.allocator.alloc(1)[0]
    cfg = engine.config
    sizes = capture_sizes(engine.batcher.max_num_seqs * (engine.k + 1))
    max_pages = -(-max_len // engine.page_size)
    kw: dict[str, Any] = dict(
        page_size=engine.page_size, scratch_page=scratch, max_pages=max_pages, device=engine.model.device
    )
    engine.verify_graphs = HostRowRunner(engine._verify_body, engine.runner.backend, sizes, **kw)
    backend = engine.model.attention_backend("triton")
    engine.draft_graphs = HostRowRunner(
        engine._draft_body, backend, sizes, hidden_dim=cfg.hidden_size, hidden_dtype=engine.model.dtype, **kw
    )
    for runner in (engine.verify_graphs, engine.draft_graphs):
        runner.clock = clock


def instrument(engine: Engine, clock: Clock) -> None:
    """Time the forwards an engine runs outside graphs (eager target, heads, MTP block)."""
    engine.model.forward = clock.timed(engine.model.forward)  # type: ignore[method-assign]
    engine.model.compute_logits = clock.timed(engine.model.compute_logits)  # type: ignore[method-assign]
    if isinstance(engine, MTPEngine):
        engine.mtp.draft_step = clock.timed(engine.mtp.draft_step)  # type: ignore[method-assign]
        engine.mtp.compute_logits = clock.timed(engine.mtp.compute_logits)  # type: ignore[method-assign]


def measure(path: Path, b: int, k: int, steps: int, prompt_len: int) -> dict:
    kw: dict[str, Any] = dict(
        max_num_seqs=b, enable_prefix_cache=False, attention_backend="triton", page_size=16
    )
    engine = Engine.from_pretrained(path, **kw) if k == 0 else MTPEngine.load(path, mtp_k=k, **kw)
    clock = Clock()
    params = SamplingParams(temperature=0.0, max_tokens=steps * (k + 1) + 8, ignore_eos=True)
    if isinstance(engine, MTPEngine):
        host_graphs(engine, clock, prompt_len + params.max_tokens + k + 1)
    instrument(engine, clock)
    rng = random.Random(b)
    vocab = engine.config.vocab_size
    for i in range(b):
        engine.add_request(f"r{i}", [rng.randrange(2, vocab) for _ in range(prompt_len)], params)
    while any(not r.output_ids for r in engine.requests.values()):
        engine.step()
    for _ in range(3):  # first replays of each bucket
        engine.step()
    walls, hosts, host_cpu, reads, tokens = [], [], [], 0, 0
    with clock.counting_reads():
        for _ in range(steps):
            clock.device_s = clock.device_cpu_s = 0.0
            before = clock.reads
            t0, c0 = time.perf_counter(), time.thread_time()
            out = engine.step()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            walls.append(wall * 1e3)
            hosts.append((wall - clock.device_s) * 1e3)
            host_cpu.append((cpu - clock.device_cpu_s) * 1e3)
            reads += clock.reads - before
            tokens += sum(len(o.token_ids) for o in out)
    step_ms = statistics.median(walls)
    host_ms = statistics.median(hosts)
    row: dict[str, Any] = {
        "batch": b, "k": k, "step_ms": round(step_ms, 3), "device_ms": round(step_ms - host_ms, 3),
        "host_ms": round(host_ms, 3), "host_cpu_ms": round(statistics.median(host_cpu), 3),
        "host_reads_per_step": round(reads / steps, 2),
        "tokens_per_step": round(tokens / steps / b, 3),
    }  # fmt: skip
    if isinstance(engine, MTPEngine):
        row["acceptance_rate"] = round(engine.acceptance_rate, 3)
    return row


def run(a: argparse.Namespace) -> dict:
    from libs.demo.cache import cached_demo_model

    torch.set_num_threads(max(a.threads, 1))
    path = Path(a.model) if a.model else cached_demo_model()
    if path is None:
        raise SystemExit("no demo model cached: `make demo` first, or pass --model DIR")
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        for k in sorted({0, *(int(x) for x in a.ks.split(","))}):
            row = measure(path, b, k, a.host_steps, a.prompt_len)
            rows.append(row)
            print(row, flush=True)
    return {
        "benchmark": "mtp", "mode": "host", "model": path.name, "steps": a.host_steps,
        "note": "CPU, Triton-backend decode rows with graph replays emulated (bench/mtp_host.py)",
        "results": rows,
    }  # fmt: skip
