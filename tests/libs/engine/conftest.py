"""Engine tests that run a Triton kernel on CPU tensors use Triton's interpreter, set up exactly as the
kernel tests set it up (TRITON_INTERPRET=1 before triton is first imported, plus the interpreter patches):
importing that conftest here does it at collection time, whichever folder is collected first."""

from __future__ import annotations

from tests.libs.kernels.conftest import HAS_CUDA  # noqa: F401  (the import sets the interpreter up)
