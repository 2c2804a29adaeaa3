"""The one place an EP dispatch backend is chosen by name ("torch", "deepep", "mooncake").

Every backend module imports without its library (DeepEP and Mooncake EP load theirs when a dispatcher is
built), so this module imports them all and a missing library is reported only for the backend asked for.
"""

from __future__ import annotations

from typing import Any

import torch

from libs.ep.comm import Comm
from libs.ep.dispatch.all_to_all import AllToAllDispatcher
from libs.ep.dispatch.base import Dispatcher
from libs.ep.dispatch.deepep import DeepEPDispatcher, deepep_api
from libs.ep.dispatch.deepep_v2 import DeepEPV2Dispatcher
from libs.ep.dispatch.mooncake_ep import MooncakeEPDispatcher

BACKENDS = ("torch", "deepep", "mooncake")


def make_dispatcher(
    backend: str, comm: Comm, *, slots_per_rank: int, num_physical: int, hidden: int,
    dtype: torch.dtype, fp8: bool = False, group=None, **options: Any,
) -> Dispatcher:  # fmt: skip
    """The dispatcher named by `backend`. DeepEP and Mooncake EP need their libraries and CUDA; a missing one
    is a RuntimeError naming what to install."""
    if backend == "torch":
        return AllToAllDispatcher(comm, slots_per_rank, fp8=fp8, combine_dtype=options.get("combine_dtype"))
    if backend == "deepep":  # DeepEP's V1 Buffer where the installed deep_ep has it, else V2's EPBuffer
        if deepep_api() == "v2":
            return DeepEPV2Dispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
        return DeepEPDispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
    if backend == "mooncake":
        return MooncakeEPDispatcher(group, comm, num_physical, hidden, dtype, fp8=fp8, **options)
    raise ValueError(f"unknown EP dispatch backend {backend!r}: use one of {BACKENDS}")
