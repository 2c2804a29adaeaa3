"""Hand glibc's freed-but-kept heap back to the OS (`malloc_trim(0)`, as Dask's workers do), opt-in by the
`malloc_trim_s` setting: after a burst (a prefill worker's restart re-sending prompts, a long prompt prefilled on
the decode worker) glibc keeps the freed chunks, so RSS stays up though nothing uses them."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("moemesh.heap")


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(lib, "malloc_trim", None)  # glibc only (musl and macOS have none)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def available() -> bool:
    return _TRIM is not None


def trim() -> bool:
    """Release what glibc can (it releases the GIL: ctypes); True when memory went back to the OS."""
    return bool(_TRIM(0)) if _TRIM is not None else False
