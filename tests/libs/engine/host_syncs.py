"""Calls that make the host wait for the device, caught at the torch-function level, so that a CPU test can
say where a GPU forward would stall: `.item()`, `.tolist()`, `int(t)` / `bool(t)` / `float(t)`, `nonzero`,
`unique`, `bincount`, `masked_select`, boolean-mask indexing, and `repeat_interleave` with tensor repeats
and no `output_size` (each needs a device value or a size on the host). CUDA's own sync debug mode
(torch.cuda.set_sync_debug_mode) answers the same on a GPU; this works on any device, the Triton
interpreter's own calls left out."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[3]
LIBS = f"{REPO / 'libs'}/"
T = torch.Tensor
SYNCING = {
    T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, torch.nonzero, T.nonzero, torch.unique,
    T.unique, torch.bincount, T.bincount, torch.masked_select, T.masked_select,
}  # fmt: skip


def _syncs(func, args, kwargs) -> bool:
    if func in SYNCING:
        return True
    if func in (torch.repeat_interleave, T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if func is T.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class HostSyncs(TorchFunctionMode):
    """`with HostSyncs() as s:` ... then `s.sites`: (call, "file:line" of the innermost frame in libs/) for
    each syncing call made meanwhile from the project's code."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            stack = traceback.extract_stack()
            ours = [f for f in stack if f.filename.startswith(LIBS)]
            if ours and not any("triton/runtime/interpreter" in f.filename for f in stack):
                path = Path(ours[-1].filename).relative_to(REPO)
                self.sites.append((getattr(func, "__name__", repr(func)), f"{path}:{ours[-1].lineno}"))
        return func(*args, **kwargs)
