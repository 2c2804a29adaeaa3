"""bench.kernel_resources on this CPU machine: kernels compiled for sm_90 with Triton's own ptxas, their
registers, spills and MMA instructions read back from the cubin. Run as a process of its own: Triton's
interpreter (other tests, this process) can leave triton.language patched, which breaks a compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(?P<name>[^:]+): (?P<regs>\d+) regs, (?P<stack>\d+) B stack, (?P<spills>\d+) spill insts, "
                  r"(?P<smem>\d+) B smem; (?P<mma>.*)$")  # fmt: skip


def test_a_lone_dot_gets_wgmma_and_the_quantization_kernel_no_mma_neither_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--kernel", "dot", "quant"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m["name"]: m for m in map(LINE.match, done.stdout.splitlines()) if m}
    dot, quant = rows["dot 64x64x64 bf16"], rows["quant rows (SwiGLU, masked)"]
    assert "HGMMA.64x64x16.F32.BF16" in dot["mma"]  # Hopper's wgmma, not mma.sync
    assert quant["mma"] == "no MMA"
    for r in (dot, quant):
        assert r["spills"] == "0" and r["stack"] == "0" and 0 < int(r["regs"]) <= 255
    assert int(dot["smem"]) > 0
