"""The one place an EP dispatch backend is chosen by name ("auto", "fixed", "torch", "deepep", "mooncake").
Backend modules import without their library (it loads when a dispatcher is built), so a missing library
is reported only for the backend asked for."""

from __future__ import annotations

from typing import Any

import torch

from libs.ep.comm import Comm
from libs.ep.dispatch.all_to_all import AllToAllDispatcher
from libs.ep.dispatch.base import Dispatcher
from libs.ep.dispatch.deepep import DeepEPDispatcher, deepep_api
from libs.ep.dispatch.deepep_v2 import DeepEPV2Dispatcher
from libs.ep.dispatch.fixed import FixedDispatcher
from libs.ep.dispatch.mooncake_ep import MooncakeEPDispatcher

BACKENDS = ("auto", "fixed", "torch", "deepep", "mooncake")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """"auto": the fixed-capacity dispatcher on CUDA (no host sync, graph-capturable), all-to-all elsewhere."""
    if backend != "auto":
        return backend
    return "fixed" if torch.device(device).type == "cuda" else "torch"


def make_dispatcher(
    backend: str, comm: Comm, *, slots_per_rank: int, num_physical: int, hidden: int,
    dtype: torch.dtype, fp8: bool = False, group=None, **options: Any,
) -> Dispatcher:  # fmt: skip
    """The dispatcher named by `backend` ("auto": by comm.device). DeepEP and Mooncake EP need their libraries
    and CUDA; a missing one is a RuntimeError naming what to install. "fixed" needs the options top_k and
    max_tokens (its buffers' rows per peer); forwards with more tokens take its all-to-all fallback."""
    backend = resolve_backend(backend, comm.device)
    if backend == "fixed":
        if "top_k" not in options or "max_tokens" not in options:
            raise ValueError("EP backend 'fixed' needs top_k and max_tokens")
        fallback = AllToAllDispatcher(comm, slots_per_rank, fp8=fp8, combine_dtype=options.get("combine_dtype"))
        return FixedDispatcher(comm, slots_per_rank, hidden=hidden, dtype=dtype, fp8=fp8, fallback=fallback, **options)
    if backend == "torch":
        return AllToAllDispatcher(comm, slots_per_rank, fp8=fp8, combine_dtype=options.get("combine_dtype"))
    if backend == "deepep":  # DeepEP's V1 Buffer where the installed deep_ep has it, else V2's EPBuffer
        if deepep_api() == "v2":
            return DeepEPV2Dispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
        return DeepEPDispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
    if backend == "mooncake":
        return MooncakeEPDispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
    raise ValueError(f"unknown EP dispatch backend {backend!r}: use one of {BACKENDS}")
