"""One EP rank's own KV pool on the transfer fabric, where DP-attention ranks keep their pools apart (on GPUs
only the rank's process can register its device's memory): `kv_endpoint`, `write_kv` (a prefill rank's
write into a decode rank's pool, issued where the source is) and `read_kv`, in the rank's own page ids."""

# The rank opens its own transport (a Mooncake engine in P2PHANDSHAKE mode, or any libs.kvtransfer
# transport) and registers its pool once; kv_endpoint returns (session id, pool layout as a KvGeometry dict).

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from libs.engine.kv_pool import KVPool
from libs.kvtransfer import MooncakeTransport, PageGeometry, make_transport, plan_page_runs

RANK_KV_CALLS = frozenset({"kv_endpoint", "write_kv", "read_kv"})


def pool_geometry(pool: KVPool) -> dict[str, Any]:
    """The fields of proto.messages.KvGeometry for `pool` (plain values: they cross the rank pipe)."""
    return dict(
        num_layers=pool.num_layers, num_pages=pool.num_pages, page_size=pool.page_size,
        page_bytes=pool.bytes_per_page, layer_stride=pool.layer_stride_bytes, base_addr=pool.data_ptr(),
        dtype=pool.format_name,
    )  # fmt: skip


class RankKv:
    def __init__(self, pool: KVPool, protocol: str, hostname: str, device_name: str = "") -> None:
        self.pool = pool
        self.transport = make_transport(protocol, hostname, device_name)
        if pool.buffer.device.type == "cuda" and isinstance(self.transport, MooncakeTransport):
            self.transport.bind_cuda_device(pool.buffer.device.index or 0)
        self.transport.register(pool.data_ptr(), pool.nbytes)

    def handle(self, name: str, args: tuple) -> Any:
        if name == "kv_endpoint":
            return self.transport.session_id, pool_geometry(self.pool)
        if name == "write_kv":
            return self.write(*args)
        if name == "read_kv":
            return self.read(*args)
        raise ValueError(f"rank KV call {name!r} is not one of {sorted(RANK_KV_CALLS)}")

    def write(
        self, src_pages: Sequence[int], dst_session: str, dst_geometry: dict[str, Any],
        dst_pages: Sequence[int], num_layers: int,
    ) -> int:  # fmt: skip
        src = PageGeometry.of_pool(self.pool)
        dst = PageGeometry(**{k: dst_geometry[k] for k in PageGeometry.__struct_fields__})
        runs = plan_page_runs(num_layers, list(src_pages), list(dst_pages), src, dst)
        if self.pool.buffer.is_cuda:  # the forward that wrote these pages has finished on the device
            torch.cuda.synchronize(self.pool.buffer.device)
        return self.transport.write(dst_session, runs)

    def read(self, pages: Sequence[int]) -> np.ndarray:
        """[L, len(pages) * page_size, C] as uint8 bytes per row, on the host."""
        bad = [p for p in pages if not 0 <= p < self.pool.num_pages]
        if bad:
            raise ValueError(f"pages {bad[:8]} outside this rank's pool of {self.pool.num_pages} pages")
        ps = self.pool.page_size
        rows = (
            torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])
            if pages
            else torch.empty(0, dtype=torch.long)
        )
        got = self.pool.buffer.index_select(1, rows.to(self.pool.buffer.device)).cpu()
        return got.contiguous().view(torch.uint8).numpy()

    def close(self) -> None:
        self.transport.close()
