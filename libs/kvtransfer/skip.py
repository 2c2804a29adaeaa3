"""A KV transport that moves nothing, for the timing-model engine (libs/sim): `write` checks the run plan as the
real transports do and returns its byte count, so handles, leases, KvReady and the transfer metrics all run;
no bytes are copied and no sockets opened."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from libs.kvtransfer.base import KvTransport, Run, check_runs

_ids = itertools.count(1)


class SkipTransport(KvTransport):
    def __init__(self) -> None:
        self._session = f"skip:{next(_ids)}"
        self.bytes_planned = 0

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, ptr: int, length: int) -> None:
        if ptr <= 0 or length <= 0:
            raise ValueError(f"register needs a positive address and length, got {ptr:#x}, {length}")

    def unregister(self, ptr: int) -> None:
        pass

    def write(self, remote_session: str, runs: Sequence[Run]) -> int:
        total = check_runs(runs)
        self.bytes_planned += total
        return total

    def close(self) -> None:
        pass
