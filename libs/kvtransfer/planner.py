"""Pure planning of a KV page transfer: which byte runs to copy, merged as far as memory allows."""

# Both pools have the KVPool layout (libs.engine.kv_pool): page p of layer l starts at
# base_addr + l * layer_stride + p * page_bytes, so within a layer a stretch of pages that is consecutive on
# both sides is one contiguous run. Layers are separate runs (the layer stride spans other pages).

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from libs.kvtransfer.base import Run


class Geometry(Protocol):
    """What the planner needs of a pool's layout (proto.messages.KvGeometry and PageGeometry have it)."""

    @property
    def base_addr(self) -> int: ...
    @property
    def layer_stride(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_pages(self) -> int: ...


class PageGeometry(msgspec.Struct, frozen=True, kw_only=True):
    base_addr: int
    layer_stride: int
    page_bytes: int
    num_layers: int
    num_pages: int

    @classmethod
    def of_pool(cls, pool: Any) -> PageGeometry:
        """Geometry of a libs.engine.kv_pool.KVPool (duck-typed: the planner stays free of torch)."""
        return cls(
            base_addr=pool.data_ptr(), layer_stride=pool.layer_stride_bytes, page_bytes=pool.bytes_per_page,
            num_layers=pool.num_layers, num_pages=pool.num_pages,
        )  # fmt: skip


def check_compatible(src: Geometry, dst: Geometry) -> None:
    """Two pools can exchange pages only if a page means the same bytes on both sides."""
    if src.page_bytes != dst.page_bytes:
        raise ValueError(
            f"KV geometry mismatch: page_bytes {src.page_bytes} (source) != {dst.page_bytes} (destination); "
            "page_size, row width and dtype must agree"
        )
    if src.num_layers != dst.num_layers:
        raise ValueError(
            f"KV geometry mismatch: num_layers {src.num_layers} (source) != {dst.num_layers} (destination)"
        )


def merge_page_pairs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, count) for each stretch consecutive on both sides, in order."""
    spans: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if spans:
            s0, d0, n = spans[-1]
            if s == s0 + n and d == d0 + n:
                spans[-1] = (s0, d0, n + 1)
                continue
        spans.append((s, d, 1))
    return spans


def _check_pages(name: str, pages: Sequence[int], geom: Geometry) -> None:
    for p in pages:
        if not 0 <= p < geom.num_pages:
            raise ValueError(f"{name} page {p} out of range 0..{geom.num_pages - 1}")


def plan_page_runs(
    num_layers: int,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    src_geom: Geometry,
    dst_geom: Geometry,
) -> list[Run]:
    """Runs (src_addr, dst_addr, length) that copy page src_pages[i] onto dst_pages[i] in layers
    0..num_layers-1, layer by layer, consecutive pages merged into one run."""
    check_compatible(src_geom, dst_geom)
    if not 1 <= num_layers <= src_geom.num_layers:
        raise ValueError(f"num_layers must be in 1..{src_geom.num_layers}, got {num_layers}")
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    _check_pages("source", src_pages, src_geom)
    _check_pages("destination", dst_pages, dst_geom)
    spans = merge_page_pairs(src_pages, dst_pages)
    pb = src_geom.page_bytes
    runs: list[Run] = []
    for layer in range(num_layers):
        src_layer = src_geom.base_addr + layer * src_geom.layer_stride
        dst_layer = dst_geom.base_addr + layer * dst_geom.layer_stride
        runs.extend((src_layer + s * pb, dst_layer + d * pb, n * pb) for s, d, n in spans)
    return runs
