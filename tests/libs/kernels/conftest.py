"""Kernel tests run on CUDA where present, else under Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter must be chosen before triton is first imported, so it is set here, at collection, and
patched to compute what the GPU does (libs/kernels/interpreter.py says how; the EP rank processes a test
starts get the same patches from their forkserver's preload). (Its bf16 `tl.dot` multiplies the raw bits,
so CPU tests feed the attention kernel float16; the GPU tests use bf16.)
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    from libs.kernels.interpreter import patch_interpreter

    patch_interpreter()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _no_shipped_tuning(monkeypatch, tmp_path):
    """Kernel tests count and check their own tuning: no shipped table answers for them (tests/conftest.py
    gives each test its own tuning cache)."""
    from libs.kernels import gemm_tuning

    monkeypatch.setattr(gemm_tuning, "SHIPPED_DIR", tmp_path / "tuning-shipped")
    monkeypatch.setattr(gemm_tuning, "_STORED", None)
