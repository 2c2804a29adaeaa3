"""Under Triton's interpreter, a kernel that calls a device function (`tl.cdiv`) leaves triton.language
as it found it, so a later compile (Gluon for SM90, which runs on CPU machines too) sees the real builtins."""

from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _blocks_kernel(out_ptr, n, BLOCK: tl.constexpr):
    tl.store(out_ptr, tl.cdiv(n, BLOCK))


def _core_builtins() -> dict[str, object]:
    return {
        name: getattr(tl.core, name) for name in dir(tl.core) if tl.core.is_builtin(getattr(tl.core, name))
    }


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only on machines without CUDA")
def test_device_function_call_restores_triton_language():
    before = _core_builtins()
    out = torch.zeros(1, dtype=torch.int32)
    _blocks_kernel[(1,)](out, 300, BLOCK=128)
    assert out.item() == 3
    after = _core_builtins()
    changed = sorted(name for name in before if after[name] is not before[name])
    assert changed == []
