"""In-process KV transport for unit tests: endpoints in one process, memcpy between registered regions. As
the real fabric does, it refuses a destination outside the remote endpoint's registered regions, and (as
RDMA does, stricter than Mooncake TCP) a source outside this endpoint's."""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from libs.kvtransfer.base import KvTransport, Run, TransferError, check_runs

_lock = threading.Lock()
_endpoints: dict[str, InProcessTransport] = {}  # process-wide: session id -> live endpoint
_ids = itertools.count(1)


def _inside(regions: dict[int, int], addr: int, length: int) -> bool:
    return any(base <= addr and addr + length <= base + size for base, size in regions.items())


class InProcessTransport(KvTransport):
    def __init__(self) -> None:
        self._session = f"inproc:{next(_ids)}"
        self._regions: dict[int, int] = {}
        with _lock:
            _endpoints[self._session] = self

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, ptr: int, length: int) -> None:
        if ptr <= 0 or length <= 0:
            raise ValueError(f"register needs a positive address and length, got {ptr:#x}, {length}")
        with _lock:
            self._regions[ptr] = length

    def unregister(self, ptr: int) -> None:
        with _lock:
            self._regions.pop(ptr, None)

    def write(self, remote_session: str, runs: Sequence[Run]) -> int:
        total = check_runs(runs)
        with _lock:
            remote = _endpoints.get(remote_session)
            if remote is None:
                raise TransferError(f"no in-process endpoint {remote_session!r}")
            for src, dst, length in runs:
                if not _inside(self._regions, src, length):
                    raise TransferError(
                        f"source {src:#x}+{length} is not in a region registered by {self._session}"
                    )
                if not _inside(remote._regions, dst, length):
                    raise TransferError(
                        f"destination {dst:#x}+{length} is not registered by {remote_session}"
                    )
            for src, dst, length in runs:
                ctypes.memmove(dst, src, length)
        return total

    def close(self) -> None:
        with _lock:
            _endpoints.pop(self._session, None)
            self._regions.clear()

    @staticmethod
    def live_sessions() -> list[str]:
        """Session ids of endpoints not yet closed (tests assert none leak)."""
        with _lock:
            return list(_endpoints)
