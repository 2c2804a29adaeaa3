"""What a Triton kernel of the project costs in registers, local-memory spills, shared memory and which MMA
instructions it got, compiled for sm_90 on any machine (Triton ships ptxas and cuobjdump): spills show without a
GPU, speed still needs one. `python -m bench.kernel_resources [--kernel mla-fp8 mla quant dot mla-fp8-sm90 gemm-ws] [--config BH-BN-W-S]`
(run it without TRITON_INTERPRET: a process that has run the interpreter may keep triton.language patched)"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

_MMA = re.compile(r"\b([HQ]GMMA\.[0-9A-Za-z.]+|HMMA\.[0-9A-Za-z.]+)")
_SPILL = re.compile(r"\b(STL|LDL)\b")


@dataclass
class Resources:
    registers: int
    stack_bytes: int
    spill_instructions: int  # STL/LDL in the SASS: local-memory traffic, mostly spills
    shared_bytes: int
    mma: dict[str, int]  # SASS MMA instruction -> count (HGMMA/QGMMA: wgmma; HMMA: mma.sync)

    def line(self) -> str:
        mma = ", ".join(f"{k} x{v}" for k, v in sorted(self.mma.items())) or "no MMA"
        return (f"{self.registers} regs, {self.stack_bytes} B stack, {self.spill_instructions} spill insts, "
                f"{self.shared_bytes} B smem; {mma}")  # fmt: skip


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any], floats: tuple[str, ...] = (),
                 num_warps: int = 4, num_stages: int = 2) -> Any:  # fmt: skip
    """fn's arguments: pointers (name -> "*bf16"...), constexprs, floats ("fp32"); the rest int32. Under
    TRITON_INTERPRET=1 (the tests) the kernel's own function is compiled."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(fn, InterpretedFunction):
        fn = JITFunction(fn.fn)

    def kind(name: str) -> str:
        if name in pointers:
            return pointers[name]
        return "constexpr" if name in constexprs else "fp32" if name in floats else "i32"

    src = ASTSource(fn=fn, signature={n: kind(n) for n in fn.arg_names}, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resources(compiled: Any) -> Resources:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True)
    regs = re.search(r"REG:(\d+)", usage.stdout)
    stack = re.search(r"STACK:(\d+)", usage.stdout)
    return Resources(
        registers=int(regs.group(1)) if regs else -1, stack_bytes=int(stack.group(1)) if stack else -1,
        spill_instructions=len(_SPILL.findall(sass.stdout)), shared_bytes=int(compiled.metadata.shared),
        mma=dict(Counter(_MMA.findall(sass.stdout))),
    )  # fmt: skip


def compile_gluon_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: Any) -> Any:
    """A Gluon kernel compiled for sm_90a: signature maps its run-time arguments to types, constexprs its
    compile-time ones; options as its launcher passes them (num_warps, maxnreg)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    names = list(sig)
    src = GluonASTSource(fn, sig, {(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


_MLA_STRIDES = ["stride_qb", "stride_qh", "stride_rb", "stride_rh", "stride_ptb", "stride_ptp", "stride_ob",
                "stride_oh", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh", "NUM_SPLITS"]  # fmt: skip


def mla_fp8_sm90(schedule: str = "pipelined", direct: bool = False) -> Any:
    """The SM90 FP8 MLA decode compiled as its launcher compiles it: "pipelined" (mla_decode_fp8_sm90, 8 warps)
    or "seesaw" (mla_decode_fp8_sm90_seesaw: 4 + 4 + 1 warps, maxnreg 168); direct: one split (no partials)."""
    from libs.kernels import mla_decode_fp8_sm90 as S
    from libs.kernels import mla_decode_fp8_sm90_seesaw as W

    sig = {
        "lat_desc": f"tensordesc<fp8e4nv[64, 128],{S.lat_layout()!r}>",
        "rope_desc": f"tensordesc<bf16[64, 64],{S.rope_layout()!r}>",
        "scale_desc": f"tensordesc<fp32[64, 4],{S.scale_layout()!r}>",
        "QL": "*bf16", "QR": "*bf16", "PT": "*i32", "SEQ": "*i32", "O": "*bf16", "OPART": "*fp32",
        "LSE": "*fp32", "sm_scale_log2": "fp32", **dict.fromkeys(_MLA_STRIDES, "i32"),
    }  # fmt: skip
    if schedule == "seesaw":
        const = dict(DIRECT_OUT=direct, NUM_STAGES=W.STAGES, num_warps=4)
        return compile_gluon_sm90(W._mla_fp8_seesaw_kernel, sig, const, num_warps=4, maxnreg=168)
    const = dict(DIRECT_OUT=direct, NUM_STAGES=S.STAGES, num_warps=8)
    return compile_gluon_sm90(S._mla_fp8_sm90_kernel, sig, const, num_warps=8)


def fp8_gemm_sm90(cfg: tuple[int, int, int, int, int], layout: int, split_k: int = 1) -> Any:
    """The Gluon FP8 GEMM (fp8_gemm_sm90) for one of its CONFIGS, a layout and a split-K factor."""
    from libs.kernels import fp8_gemm as G
    from libs.kernels import fp8_gemm_sm90 as S

    bm, bn, warps, buffers, unroll = cfg
    sig = {
        "a_desc": f"tensordesc<fp8e4nv[{bm}, 128],{S._shared_layout([bm, 128])!r}>",
        "b_desc": f"tensordesc<fp8e4nv[{bn}, 128],{S._shared_layout([bn, 128])!r}>",
        "c_ptr": "*fp32" if split_k > 1 else "*bf16",
        "as_ptr": "*fp32", "bs_ptr": "*fp32", "counts_ptr": "*i32", "tile_expert_ptr": "*i32",
        **dict.fromkeys(["M", "N", "K", "a_rows_per_expert", "stride_ce", "stride_cm", "stride_se", "stride_sm",
                         "stride_sk", "stride_bse", "stride_bsn", "stride_bsk"], "i32"),
    }  # fmt: skip
    const = dict(LAYOUT=layout, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=buffers, SPLIT_K=split_k, OVERLAP=unroll > 1,
                 UNROLL=unroll, GROUP_M=G.group_m_for(bm), num_warps=warps)  # fmt: skip
    return compile_gluon_sm90(S._fp8_gemm_sm90_kernel, sig, const, num_warps=warps)


def fp8_gemm_ws(cfg: tuple[int, int, int], layout: int) -> Any:
    """The persistent warp-specialized FP8 GEMM (fp8_gemm_sm90_ws) for one of its CONFIGS and a layout."""
    from libs.kernels import fp8_gemm_sm90 as S
    from libs.kernels import fp8_gemm_sm90_ws as W

    bn, buffers, unroll = cfg
    sig = {
        "a_desc": f"tensordesc<fp8e4nv[128, 128],{S._shared_layout([128, 128])!r}>",
        "b_desc": f"tensordesc<fp8e4nv[{bn}, 128],{S._shared_layout([bn, 128])!r}>",
        "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32", "counts_ptr": "*i32", "tile_expert_ptr": "*i32",
        **dict.fromkeys(["M", "N", "K", "a_rows_per_expert", "num_e", "stride_ce", "stride_cm", "stride_se",
                         "stride_sm", "stride_sk", "stride_bse", "stride_bsn", "stride_bsk"], "i32"),
    }  # fmt: skip
    const = dict(LAYOUT=layout, BLOCK_N=bn, NUM_BUFFERS=buffers, UNROLL=unroll, GROUP_M=8, num_warps=4)
    return compile_gluon_sm90(W._fp8_gemm_sm90_ws_kernel, sig, const, num_warps=4, maxnreg=168)


def wgmma_serialized(compiled: Any) -> bool:
    """Whether ptxas serialized the kernel's WGMMAs (its C7514 "Potential Performance Loss": a register of a WGMMA
    in flight read or moved, e.g. an accumulator carried through a branch), which waits for every one of them."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        arch = "sm_90a" if ".target sm_90a" in compiled.asm["ptx"] else "sm_90"
        run = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return "C7514" in run.stdout + run.stderr


def _mla_fp8(cfg: tuple[int, int, int, int], dots: str) -> Resources:
    from libs.kernels import mla_decode_fp8 as K
    from libs.kernels.fused import FP8_SCALE_OFFSET

    bh, bn, warps, stages = cfg
    pointers = {"QL": "*bf16", "QR": "*bf16", "KV8": "*fp8e4nv", "KVR": "*bf16", "KVS": "*fp32", "PT": "*i32",
                "SEQ": "*i32", "O": "*bf16", "OPART": "*fp32", "LSE": "*fp32"}  # fmt: skip
    consts = dict(PAGE_SIZE=64, DIRECT_OUT=False, BLOCK_H=bh, BLOCK_N=bn, D_LAT=512, D_ROPE=64, ROPE_IDX=256,
                  SCALE_IDX=FP8_SCALE_OFFSET // 4, FMAX=K.FP8_MAX, QK_FP8=dots != "bf16", PV_FP8=dots == "fp8")  # fmt: skip
    return resources(compile_sm90(K._mla_fp8_split_kernel, pointers, consts, ("sm_scale_log2",), warps, stages))


def _mla(cfg: tuple[int, int, int, int]) -> Resources:
    from libs.kernels import mla_decode as M

    bh, bn, warps, stages = cfg
    pointers = {"QL": "*bf16", "QR": "*bf16", "KV": "*bf16", "PT": "*i32", "SEQ": "*i32", "O": "*bf16",
                "OPART": "*fp32", "LSE": "*fp32"}  # fmt: skip
    consts = dict(PAGE_SIZE=64, DIRECT_OUT=False, BLOCK_H=bh, BLOCK_N=bn, D_LAT=512, D_ROPE=64)
    return resources(compile_sm90(M._mla_split_kernel, pointers, consts, ("sm_scale_log2", "out_scale"), warps, stages))


def quant_rows(swiglu: bool = True, masked: bool = True) -> Resources:
    from libs.kernels import quant as Q

    pointers = {"X": "*bf16", "XQ": "*fp8e4nv", "XS": "*fp32", "COUNTS": "*i32"}
    consts = dict(SWIGLU=swiglu, MASKED=masked, GROUPS_POW2=16, GROUP_SIZE=128, FMAX=448.0)
    return resources(compile_sm90(Q._quant_rows_kernel, pointers, consts, num_warps=4, num_stages=1))


@triton.jit
def _dot64(A, B, C, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(A + r[:, None] * BLOCK + r[None, :])
    b = tl.load(B + r[:, None] * BLOCK + r[None, :])
    tl.store(C + r[:, None] * BLOCK + r[None, :], tl.dot(a, b))


def dot_reference() -> Resources:
    """A lone 64x64x64 bf16 dot: it gets wgmma and no spills (a check on reading the SASS)."""
    return resources(compile_sm90(_dot64, {"A": "*bf16", "B": "*bf16", "C": "*fp32"}, {"BLOCK": 64}))


def main(argv: list[str] | None = None) -> None:
    from libs.kernels.mla_decode import MLAConfig
    from libs.kernels.mla_decode_fp8 import DOTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kernels = ["mla-fp8", "mla", "quant", "dot", "mla-fp8-sm90", "gemm-ws"]
    ap.add_argument("--kernel", nargs="+", default=kernels[:3], choices=kernels)
    ap.add_argument("--config", nargs="+", default=None, help="MLA tiles BLOCK_H-BLOCK_N-warps-stages (default: "
                    "the kernels' default)")  # fmt: skip
    a = ap.parse_args(argv)
    d = MLAConfig()
    configs = [tuple(int(x) for x in c.split("-")) for c in a.config] if a.config else [
        (d.block_h, d.block_n, d.num_warps, d.num_stages)]  # fmt: skip
    for name in a.kernel:
        if name in ("mla-fp8-sm90", "gemm-ws"):  # the Gluon kernels, with whether ptxas serialized their WGMMAs
            from libs.kernels import fp8_gemm_sm90_ws

            if name == "mla-fp8-sm90":
                builds = {f"{name} {s}": functools.partial(mla_fp8_sm90, s) for s in ("pipelined", "seesaw")}
            else:
                builds = {f"{name} {'-'.join(map(str, c))} layout {lay}": functools.partial(fp8_gemm_ws, c, lay)
                          for c in fp8_gemm_sm90_ws.CONFIGS for lay in (0, 1, 2)}  # fmt: skip
            for label, build in builds.items():
                compiled = build()
                print(f"{label}: {resources(compiled).line()}; WGMMAs serialized: {wgmma_serialized(compiled)}",
                      flush=True)  # fmt: skip
            continue
        if name in ("quant", "dot"):
            r = quant_rows() if name == "quant" else dot_reference()
            print(f"{'quant rows (SwiGLU, masked)' if name == 'quant' else 'dot 64x64x64 bf16'}: {r.line()}", flush=True)
            continue
        for cfg in configs:
            for dots in DOTS if name == "mla-fp8" else ("bf16 rows",):
                r = _mla_fp8(cfg, dots) if name == "mla-fp8" else _mla(cfg)  # type: ignore[arg-type]
                print(f"{name} {dots} {'-'.join(map(str, cfg))}: {r.line()}", flush=True)


if __name__ == "__main__":
    main()
