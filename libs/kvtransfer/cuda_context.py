"""Make a GPU's primary CUDA context current on the calling thread, through the driver (ctypes: no CUDA Python
package needed), for a library that calls the CUDA driver API there (Mooncake's nvlink_intra transport)."""

# Mooncake asks `cuMemGetAddressRange` about the memory it registers, which fails with error 201
# (CUDA_ERROR_INVALID_CONTEXT) on a thread where nothing made a context current, such as a worker's
# event-loop thread when the engine was loaded on another. The CUDA runtime (and so torch) binds the primary
# context to a thread lazily, on its first runtime call; this binds it at once.

from __future__ import annotations

import ctypes
import threading

_bound = threading.local()  # .device: the device whose primary context this thread has made current
_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CUDA driver {call} failed: CUresult {rc}")


def bind_primary_context(device: int) -> None:
    """Device `device`'s primary context becomes current on this thread (once per thread and device)."""
    if getattr(_bound, "device", None) == device:
        return
    lib = _driver()
    _check(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _bound.device = device
