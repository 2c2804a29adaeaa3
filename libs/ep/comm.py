"""The collectives an EP rank needs, over torch.distributed (gloo on CPU, NCCL on GPU) or, for unit tests,
`InProcessHub` (N ranks as N threads: a barrier and a mailbox; a broken barrier raises instead of hanging).
Every rank of a group calls the same collectives in the same order (runtime.py's lockstep)."""

# Tensors go as raw bytes (rows viewed as uint8), so any dtype (fp8, bf16) crosses gloo and NCCL alike.

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Pending:
    """An exchange that has been started: `wait()` finishes it and returns its result (once; later calls
    return the same). Two-batch overlap computes between the start and the wait."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish: Callable[[], Any] | None = finish
        self._value: Any = None

    @classmethod
    def done(cls, value: Any) -> Pending:
        return cls(lambda: value)

    def then(self, fn: Callable[[Any], Any]) -> Pending:
        """A Pending whose result is fn(this one's result)."""
        return Pending(lambda: fn(self.wait()))

    def wait(self) -> Any:
        if self._finish is not None:
            self._value, self._finish = self._finish(), None
        return self._value


class Comm(ABC):
    rank: int
    size: int
    device: torch.device

    @abstractmethod
    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (same length on every rank), in rank order."""

    @abstractmethod
    def _all_to_all_bytes(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> torch.Tensor:
        """send [sum(send_rows), B] uint8 -> [sum(recv_rows), B] uint8; rows to rank j are contiguous."""

    def _all_to_all_bytes_start(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> Pending:
        """`_all_to_all_bytes` started; a backend with asynchronous collectives overrides it."""
        return Pending.done(self._all_to_all_bytes(send, send_rows, recv_rows))

    def _send_bytes(
        self, send: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int]
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """send [R, ...] checked against the splits and viewed as [R, bytes] uint8; -> (bytes, trailing shape)."""
        if len(send_rows) != self.size or len(recv_rows) != self.size or sum(send_rows) != send.shape[0]:
            raise ValueError(
                f"all_to_all: {send.shape[0]} rows, send_rows {list(send_rows)}, group of {self.size}"
            )
        tail = tuple(send.shape[1:])
        return send.contiguous().view(send.shape[0], math.prod(tail)).view(torch.uint8), tail

    def all_to_all_start(
        self, send: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int]
    ) -> Pending:
        """`all_to_all` started: every rank starts its exchanges in the same order; wait() -> the rows."""
        raw, tail = self._send_bytes(send, send_rows, recv_rows)
        n, dtype = sum(recv_rows), send.dtype
        pending = self._all_to_all_bytes_start(raw, list(send_rows), list(recv_rows))
        return pending.then(lambda out: out.view(dtype).view(n, *tail))

    def all_to_all(
        self, send: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int]
    ) -> torch.Tensor:
        """Rows of `send` [R, ...] go to ranks in order (send_rows[j] rows to rank j); returns the rows received,
        recv_rows[i] from rank i, in rank order, same trailing shape and dtype."""
        raw, tail = self._send_bytes(send, send_rows, recv_rows)
        out = self._all_to_all_bytes(raw, list(send_rows), list(recv_rows))
        return out.view(send.dtype).view(sum(recv_rows), *tail)

    def all_to_all_equal(self, out: torch.Tensor, send: torch.Tensor) -> None:
        """Equal splits, no host sync: send [N * R, B] uint8 (rows [j*R, (j+1)*R) go to rank j) -> out, the
        same shape (rows from rank i at [i*R, (i+1)*R)). Shapes alone fix the sizes, so it can be captured in
        a CUDA graph (NCCL)."""
        if send.shape != out.shape or send.dtype != torch.uint8 or send.shape[0] % self.size:
            raise ValueError(f"all_to_all_equal: send {tuple(send.shape)} {send.dtype}, out {tuple(out.shape)}")
        self._all_to_all_equal(out, send)

    def _all_to_all_equal(self, out: torch.Tensor, send: torch.Tensor) -> None:
        rows = [send.shape[0] // self.size] * self.size
        out.copy_(self._all_to_all_bytes(send, rows, rows))


class TorchComm(Comm):
    """torch.distributed over `group` (None: the default group). Small control tensors live on `device`
    (CPU for gloo, the rank's GPU for NCCL)."""

    def __init__(self, group=None, device: torch.device | str = "cpu") -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self.dist.all_gather(out, mine, group=self.group)
        return torch.stack(out).tolist()

    def _all_to_all_bytes_start(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> Pending:
        """Asynchronous: gloo runs it on its own thread, NCCL on its own stream (wait() makes the current
        stream wait for it); `send` stays referenced until then."""
        out = torch.empty(sum(recv_rows), send.shape[1], dtype=torch.uint8, device=send.device)
        work = self.dist.all_to_all_single(out, send, recv_rows, send_rows, group=self.group, async_op=True)

        def finish(keep: torch.Tensor = send) -> torch.Tensor:  # `keep`: send lives until the wait
            work.wait()
            return out

        return Pending(finish)

    def _all_to_all_bytes(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> torch.Tensor:
        out = torch.empty(sum(recv_rows), send.shape[1], dtype=torch.uint8, device=send.device)
        self.dist.all_to_all_single(out, send, recv_rows, send_rows, group=self.group)
        return out

    def _all_to_all_equal(self, out: torch.Tensor, send: torch.Tensor) -> None:
        self.dist.all_to_all_single(out, send, group=self.group)


class InProcessHub:
    """A group of `size` ranks inside one process (one thread per rank); `comm(rank)` is each one's Comm."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.box: list[object] = [None] * size

    def comm(self, rank: int) -> InProcessComm:
        return InProcessComm(self, rank)

    def exchange(self, rank: int, item: object) -> list[object]:
        """Everyone posts one item and gets everyone's, in rank order."""
        self.box[rank] = item
        self.barrier.wait()
        items = list(self.box)
        self.barrier.wait()  # nobody posts the next item before everyone has read this one
        return items


class InProcessComm(Comm):
    def __init__(self, hub: InProcessHub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.device = torch.device("cpu")

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return [list(v) for v in self.hub.exchange(self.rank, list(values))]  # type: ignore[call-overload]

    def _all_to_all_bytes(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> torch.Tensor:
        parts = list(torch.split(send, send_rows))
        posted = self.hub.exchange(self.rank, parts)
        got = [posted[src][self.rank] for src in range(self.size)]  # type: ignore[index]
        if [p.shape[0] for p in got] != recv_rows:
            raise RuntimeError(
                f"rank {self.rank} expected {recv_rows} rows, peers sent {[p.shape[0] for p in got]}"
            )
        return torch.cat(got).clone() if got else send.new_empty((0, send.shape[1]))
