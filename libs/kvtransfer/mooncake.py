"""KV transport over the Mooncake transfer engine (`mooncake.engine.TransferEngine`)."""

# Metadata mode P2PHANDSHAKE: no etcd/metadata server; a peer is named by "host:rpc_port" and the engines
# exchange segment descriptors directly on first contact. Protocols: "tcp" (any machine, the non-cuda
# wheel; tests and CI), "rdma" (across hosts; `device_name` picks the NIC(s), e.g. "mlx5_0"), and
# "nvlink_intra" (GPUs of one host; the CUDA wheel with MC_INTRANODE_NVLINK=1).

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from libs.kvtransfer.base import MAX_BATCH_BYTES, KvTransport, Run, TransferError, check_runs, split_batches
from libs.kvtransfer.cuda_context import bind_primary_context

PROTOCOLS = ("tcp", "rdma", "nvlink_intra")


def _load_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the wheel, or a system library it loads (libibverbs, libnuma), is missing
        raise TransferError(
            f"cannot import mooncake.engine ({e}); install mooncake-transfer-engine-non-cuda (CPU) or the CUDA "
            "wheel, and the system libraries libibverbs1 and libnuma1 (scripts/bootstrap.sh does this)"
        ) from e
    return TransferEngine


class MooncakeTransport(KvTransport):
    def __init__(self, protocol: str = "tcp", hostname: str = "127.0.0.1", device_name: str = "") -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown Mooncake protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
        if not hostname:
            raise ValueError("hostname must be the address peers reach this engine at")
        self.protocol = protocol
        # the binding holds the GIL for part or all of a call (base.py): bound each call to a short transfer
        # at the protocol's speed (RDMA / NVLink move far more per call than TCP, and there each extra call
        # would cost more than the GIL it frees)
        self.max_batch_bytes = MAX_BATCH_BYTES if protocol == "tcp" else 64 << 20
        self._engine = _load_engine_class()()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, {device_name!r}) failed: rc={rc}"
            )
        self._session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()
        self._cuda_device: int | None = None

    def bind_cuda_device(self, device: int) -> None:
        """The registered memory lives on GPU `device`: every call into the engine first makes that GPU's
        primary context current on the calling thread (nvlink_intra queries it with the driver API)."""
        self._cuda_device = device

    def _bind(self) -> None:
        if self._cuda_device is not None:
            bind_primary_context(self._cuda_device)

    @property
    def session_id(self) -> str:
        return self._session

    def _live_engine(self) -> Any:
        if self._engine is None:
            raise TransferError(f"Mooncake transport {self._session} is closed")
        return self._engine

    def register(self, ptr: int, length: int) -> None:
        if ptr <= 0 or length <= 0:
            raise ValueError(f"register needs a positive address and length, got {ptr:#x}, {length}")
        self._bind()
        with self._lock:
            rc = self._live_engine().register_memory(ptr, length)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory({ptr:#x}, {length}) failed: rc={rc}")
            self._regions[ptr] = length

    def unregister(self, ptr: int) -> None:
        self._bind()
        with self._lock:
            if self._regions.pop(ptr, None) is not None:
                self._live_engine().unregister_memory(ptr)

    def write(self, remote_session: str, runs: Sequence[Run]) -> int:
        total = check_runs(runs)
        if not runs:
            return 0
        engine = self._live_engine()
        self._bind()
        for batch in split_batches(runs, self.max_batch_bytes):  # bounded calls: the binding holds the GIL
            rc = engine.batch_transfer_sync_write(
                remote_session, [r[0] for r in batch], [r[1] for r in batch], [r[2] for r in batch]
            )
            if rc != 0:
                raise TransferError(
                    f"Mooncake write of {len(runs)} runs ({total} bytes) from {self._session} to "
                    f"{remote_session} failed: rc={rc} (peer down, or a destination outside its registered memory)"
                )
        return total

    def close(self) -> None:
        with self._lock:
            if self._engine is None:
                return
            for ptr in list(self._regions):
                self._engine.unregister_memory(ptr)
            self._regions.clear()
            self._engine = None  # the engine shuts its transport down when released
