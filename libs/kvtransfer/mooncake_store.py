"""Mooncake Store as the engine's `PageStore`, for the store-tier thread only: an embedded client that lends
`segment_bytes` of its RAM to the store's pool and copies pages straight from and into its registered host KV
pool. Metadata goes through the P2P handshake, so only the master's address is needed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import socket
from collections.abc import Sequence
from typing import Any

from libs.engine.page_store import PageStore

log = logging.getLogger("moemesh.kvtransfer.mooncake_store")
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
ALREADY_EXISTS = -706  # OBJECT_ALREADY_EXISTS: another worker put the same (immutable) page first


# where the store's client lives: mooncake.store (0.3.13 wheels), mooncake._store (the CUDA 13 wheel 0.3.14)
STORE_MODULES = ("mooncake.store", "mooncake._store")


def _store_module() -> str | None:
    for name in STORE_MODULES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def store_unavailable() -> str | None:
    """Why this Python cannot be a Mooncake Store client (None when it can), naming the installed wheel."""
    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda, or the CUDA wheel)"
    if _store_module() is None:
        wheel = ", ".join(importlib.metadata.packages_distributions().get("mooncake", [])) or "the installed wheel"
        return (f"{wheel} has the transfer engine but not Mooncake Store (neither of {', '.join(STORE_MODULES)}; "
                "a pruned wheel?): mooncake-transfer-engine, -non-cuda and -cuda13 ship both")  # fmt: skip
    return None


class MooncakePageStore(PageStore):
    def __init__(
        self, master: str, *, hostname: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
        segment_bytes: int = 256 << 20, local_buffer_bytes: int = 16 << 20,
    ) -> None:  # fmt: skip
        if not master or ":" not in master:
            raise ValueError(f"kv store master must be host:port, got {master!r}")
        self.master, self.hostname, self.protocol, self.device = master, hostname, protocol, device
        self.segment_bytes, self.local_buffer_bytes = segment_bytes, local_buffer_bytes
        self._store: Any = None
        self._healthy = False  # the last call worked

    def connect(self) -> None:
        module = _store_module()
        if module is None:
            raise ConnectionError(f"Mooncake Store client unavailable: {store_unavailable()}")
        MooncakeDistributedStore = importlib.import_module(module).MooncakeDistributedStore  # noqa: N806
        host, port = self.master.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2.0):
            pass  # raises while the master is not there: setup would block every thread for minutes
        store = MooncakeDistributedStore()
        rc = store.setup(
            self.hostname, "P2PHANDSHAKE", self.segment_bytes, self.local_buffer_bytes, self.protocol,
            self.device, self.master,
        )  # fmt: skip
        if rc != 0:
            raise ConnectionError(f"Mooncake Store setup with master {self.master} failed ({rc})")
        self._store, self._healthy = store, True

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._live().register_buffer(ptr, nbytes)
        if rc != 0:
            raise ConnectionError(f"Mooncake Store refused to register {nbytes} bytes ({rc})")

    def exists(self, names: Sequence[str]) -> list[bool]:
        codes = self._live().batch_is_exist(list(names))
        self._healthy = all(c >= 0 for c in codes)
        if not self._healthy:
            raise ConnectionError(f"Mooncake Store exists failed ({min(codes)})")
        return [c == 1 for c in codes]

    def get_into(self, names: Sequence[str], ptrs: Sequence[int], size: int) -> list[bool]:
        codes = self._live().batch_get_into(list(names), list(ptrs), [size] * len(names))
        bad = [c for c in codes if c < 0 and c != NOT_FOUND]
        self._healthy = not bad
        if bad:
            raise ConnectionError(f"Mooncake Store get failed ({bad[0]})")
        return [c == size for c in codes]

    def put_from(self, names: Sequence[str], ptrs: Sequence[int], size: int) -> list[bool]:
        codes = self._live().batch_put_from(list(names), list(ptrs), [size] * len(names))
        self._healthy = not all(c < 0 and c != ALREADY_EXISTS for c in codes)
        if not self._healthy:
            raise ConnectionError(f"Mooncake Store put failed ({codes[0]})")
        return [c == 0 or c == ALREADY_EXISTS for c in codes]

    def close(self) -> None:
        store, self._store = self._store, None
        # close() holds the GIL until the master answers: skip it for a silent one (it drops us after client_ttl)
        if store is not None and self._healthy:
            store.close()

    def _live(self) -> Any:
        if self._store is None:
            raise ConnectionError("Mooncake Store client not connected")
        return self._store
