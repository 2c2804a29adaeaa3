"""The front's side of the rank processes: start them (forked by a forkserver), talk to them over pipes with
rank.py's tuples (`call` one rank, `op` every rank at once), stop them. A rank that exits marks the group
broken: the call that noticed raises, and so does every later one."""

# `op` reads every reply before raising the first error, so the pipes never fall out of step. Replies carry
# the rank's stats (`status`), expert load and prefix-cache events (to `on_load` / `on_events`, on the
# calling thread). Only start-up has a deadline: a long prefill is legitimate, and a hung collective ends at
# the torch.distributed timeout as an error.

from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from libs.ep.rank import RankSpec, rank_main


class RankGroup:
    def __init__(
        self,
        spec: RankSpec,
        kv_slices: list[torch.Tensor] | None,
        start_timeout_s: float,
        on_load: Callable[[np.ndarray], None],
        on_events: Callable[[int, list], None],
    ) -> None:
        self.size = spec.ep_size
        self.on_load, self.on_events = on_load, on_events
        self.status: list[dict[str, int]] = [{} for _ in range(self.size)]
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self.broken: str | None = None
        atexit.register(self.close)
        try:
            self._start(spec, kv_slices, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, spec: RankSpec, kv_slices: list[torch.Tensor] | None, timeout_s: float) -> None:
        # forkserver, not fork: no CUDA or thread state leaks into a rank; not spawn: each rank would
        # import torch again (seconds each). The preload makes the server ignore the group's SIGTERM.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["libs.ep._preload"])
        for r in range(self.size):
            parent, child = ctx.Pipe()
            kv = None if kv_slices is None else kv_slices[r]
            proc = ctx.Process(target=rank_main, args=(r, spec, child, kv), daemon=True, name=f"ep-rank-{r}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        failures = []
        for r in range(self.size):
            try:
                self._recv(r, timeout_s)
            except Exception as e:
                failures.append(f"rank {r}: {e}")
        if failures:
            raise RuntimeError(f"EP group failed to start: {'; '.join(failures)}")

    def call(self, r: int, name: str, *args: Any) -> Any:
        self._check_alive()
        self._conns[r].send(("call", name, args))
        return self._recv(r)

    def op(self, ops: dict[int, tuple[str, tuple]]) -> dict[int, Any]:
        """A group operation; ranks not in `ops` join idle. -> {rank: result} for every rank."""
        self._check_alive()
        for r in range(self.size):
            name, args = ops.get(r, ("idle", ()))
            self._conns[r].send(("op", name, args))
        results, errors = {}, []
        for r in range(self.size):
            try:
                results[r] = self._recv(r)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    def _recv(self, r: int, timeout_s: float | None = None) -> Any:
        conn, proc = self._conns[r], self._procs[r]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not conn.poll(0.5):  # returns as soon as the rank answers; the period only checks liveness
            if not proc.is_alive():
                self.broken = f"EP rank {r} exited (code {proc.exitcode})"
                raise RuntimeError(self.broken)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"EP rank {r} did not answer within {timeout_s:.0f}s")
        tag, result, status, load, events = conn.recv()
        if status is not None:
            self.status[r] = status
        if load is not None:
            self.on_load(load)
        if events:
            self.on_events(r, events)
        if tag == "err":
            raise result
        return result

    def _check_alive(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"EP group is down: {self.broken}")

    def close(self) -> None:
        """Stop every rank (idempotent); one that does not leave in time is killed."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):  # already closed, or the rank is gone
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self.broken = self.broken or "closed"
        atexit.unregister(self.close)
