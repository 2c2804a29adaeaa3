"""KV transfer interface: moves finished prompt KV pages from a prefill worker's pool into the pages a
decode worker reserved, without the bytes touching the bus."""

# Who calls what:
# - decode worker (receiver): `register(pool_ptr, pool_nbytes)` once at start, then announces
#   `session_id` and its pool geometry at the kv-broker; it makes no call per request (the writer
#   writes straight into its memory; the decode worker learns of it from `KvReady` on the bus).
# - prefill worker (writer): `register(...)` its own pool once (RDMA/NVLink need the source registered),
#   then per request `write(decode_session_id, plan_page_runs(...))`, then publishes `KvReady`.
# - both: `close()` on shutdown.
#
# `write` blocks until every run has landed (or raises TransferError); asyncio callers run it in a thread
# (`await asyncio.to_thread(t.write, session, runs)`). Mooncake's Python binding (0.3.13) holds the GIL for part
# or all of a batch call, so MooncakeTransport cuts a write into batches of at most `MAX_BATCH_BYTES` over TCP
# (64 MiB over RDMA / NVLink, whose calls finish that much sooner)
# (`split_batches`): between them the event loop and the engine thread run, instead of stalling for the
# whole prompt's KV.
# Implementations: MooncakeTransport (libs.kvtransfer.mooncake), InProcessTransport for unit tests.

from __future__ import annotations

import abc
from collections.abc import Sequence

# (local source address, remote destination address, length in bytes)
Run = tuple[int, int, int]


class TransferError(RuntimeError):
    """A transfer engine call failed (engine start, registration, or a write)."""


MAX_BATCH_BYTES = 2 << 20  # a larger TCP write holds the GIL long enough to stall the loop (bench.mesh_floors)


def split_batches(runs: Sequence[Run], max_bytes: int = MAX_BATCH_BYTES) -> list[list[Run]]:
    """The runs in order, in batches of at most max_bytes each (a longer run is cut into pieces)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    batches: list[list[Run]] = []
    cur: list[Run] = []
    size = 0
    for src, dst, length in runs:
        off = 0
        while off < length:
            if size == max_bytes:
                batches.append(cur)
                cur, size = [], 0
            n = min(length - off, max_bytes - size)
            cur.append((src + off, dst + off, n))
            size += n
            off += n
    if cur:
        batches.append(cur)
    return batches


def check_runs(runs: Sequence[Run]) -> int:
    """Validate the shape of runs; returns their total bytes."""
    total = 0
    for i, run in enumerate(runs):
        if len(run) != 3:
            raise ValueError(f"run {i} must be (src_addr, dst_addr, length), got {run!r}")
        src, dst, length = run
        if src <= 0 or dst <= 0 or length <= 0:
            raise ValueError(f"run {i} needs positive addresses and length, got {run!r}")
        total += length
    return total


class KvTransport(abc.ABC):
    """One endpoint of the KV transfer fabric (one per worker process)."""

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """What peers pass to `write` to reach this endpoint (Mooncake: "host:rpc_port")."""

    @abc.abstractmethod
    def register(self, ptr: int, length: int) -> None:
        """Make [ptr, ptr + length) of this process's memory reachable by the transfer engine."""

    @abc.abstractmethod
    def unregister(self, ptr: int) -> None:
        """Undo `register` of the region starting at ptr."""

    @abc.abstractmethod
    def write(self, remote_session: str, runs: Sequence[Run]) -> int:
        """Copy every (local src, remote dst, length) run into `remote_session`'s registered memory,
        as one batch; returns the bytes written. Raises TransferError on failure (then any subset of
        the runs may have landed) and ValueError on malformed runs (nothing sent)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unregister everything and release the engine; idempotent."""

    def __enter__(self) -> KvTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
