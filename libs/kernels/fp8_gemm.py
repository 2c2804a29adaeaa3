"""FP8 block-scaled GEMMs in Triton with DeepSeek-V3's quantization (1x128 activation scales computed on the
fly, 128x128 weight scales), in three layouts: dense, masked (CUDA-graph decode, fixed grid) and contiguous
(prefill). A shape's kernel choice comes from a tuning table or a fixed default, the same in every process."""

#   out[m, n] = sum_kb (xq[m, kb] . w[n, kb]) * xs[m, kb] * ws[n // 128, kb]      (kb: 128-wide K blocks)
# dense: x [M, K] against one weight [N, K]. masked: x [E, M_max, K] with `counts[E]` valid rows per expert,
# as a low-latency EP dispatch delivers them; tiles past a count exit at once. contiguous: rows sorted by
# expert, each run padded to BLOCK_M, `tile_expert` per row tile (-1: empty). Program order (`grouped_tile`):
# GROUP_M row tiles at a time, each group's column tiles in turn with its row tiles adjacent, so the programs
# in flight share both their activation rows and their weight tiles in L2. Decode's few row tiles are one
# group (a weight tile's row tiles adjacent, as the weights are what matters there); prefill's thousands of
# rows would otherwise stream every activation tile from HBM once per column tile.
# Choice per (layout, bucket of M, N, K, experts) via gemm_tuning.py: the Triton tile config
# (`_launch_triton`) and on SM90 fp8_gemm_sm90's Gluon configs and split-K (`_choose`, `_split_choice`); a
# table entry wins, else `default_config`, the Triton kernel, `split_k_for`.

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from libs.kernels import gemm_tuning
from libs.kernels.gemm_tuning import M_BUCKET_MAX, m_bucket
from libs.quant.fp8 import FP8_DTYPE as FP8
from libs.quant.fp8 import FP8_GROUP as GROUP
from libs.quant.fp8 import dequantize_fp8_groups

DENSE, MASKED, CONTIGUOUS = 0, 1, 2


def _on_gpu() -> bool:
    """Whether to pick kernels (tile configs, Gluon, split-K): a real GPU, not the interpreter."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def triton_usable(t: torch.Tensor) -> bool:
    """Whether libs.kernels' Triton kernels can take `t`: CUDA tensors, or CPU tensors when the kernels were
    built for Triton's interpreter (TRITON_INTERPRET=1 before libs.kernels was first imported: the tests'
    setup)."""
    if t.is_cuda:
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fp8_gemm_body, InterpretedFunction)


GROUP_ROWS = 1024  # rows per program group (`grouped_tile`): ~16 MB of activations at K = 7168 stay in L2


def group_m_for(block_m: int) -> int:
    """Row tiles per program group for `block_m`-row tiles."""
    return max(1, GROUP_ROWS // block_m)


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile): GROUP_M row tiles at a time; within a group the column tiles
    in turn, each one's row tiles adjacent."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


# M (rows; rows per expert in the masked layout) changes with every batch: unspecialized, one compile serves
# every M (Triton otherwise compiles M == 1, M % 16 == 0 and the rest apart, each compile tens of seconds).
# M only bounds masks and the tile count here, no address's alignment.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_body(
    A, AS, B, BS, C, M, N, K, COUNTS, TILE_EXPERT,
    stride_ae, stride_am, stride_se, stride_sm, stride_sk,
    stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
    stride_ce, stride_cm,
    LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr = 1,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = 0
    rows = M
    if LAYOUT == 1:  # int64: a whole layer's stacked experts pass 2**31 bytes (256 x 4096 x 7168 fp8)
        expert = tl.program_id(1).to(tl.int64)
        rows = tl.load(COUNTS + expert)
    if LAYOUT == 2:
        expert = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    if (pid_m * BLOCK_M < rows) & (expert >= 0):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < rows
        mask_n = offs_n < N
        a_ptrs = A + expert * stride_ae + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        as_ptrs = AS + expert * stride_se + offs_m * stride_sm
        bs_ptr = BS + expert * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        kb0 = 0
        kb1 = tl.cdiv(K, BLOCK_K)
        if SPLIT_K > 1:  # this program sums one slice of K into its own fp32 plane of C (summed after)
            per = tl.cdiv(kb1, SPLIT_K)
            kb0 = tl.program_id(2) * per
            kb1 = tl.minimum(kb0 + per, kb1)
            a_ptrs += kb0 * BLOCK_K
            b_ptrs += kb0 * BLOCK_K
        for kb in range(kb0, kb1):
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb * stride_sk, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptr + kb * stride_bsk)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = C + expert * stride_ce + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        if SPLIT_K > 1:  # dense only: stride_ce steps between the slices' planes
            c_ptrs += tl.program_id(2).to(tl.int64) * stride_ce
            tl.store(c_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])
        else:
            tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bm, bn, w, st in [
        (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (128, 128, 8, 3), (32, 128, 4, 5),
        (16, 128, 4, 5), (64, 64, 4, 5), (32, 64, 4, 6), (16, 64, 4, 6),
    ]
]  # fmt: skip
# (layout, m bucket, n, k, experts[, block_m]) -> the chosen one of _CONFIGS
_TRITON_CONFIG: dict[tuple, triton.Config] = {}


def configs_for(m: int) -> list[triton.Config]:
    """The tile configs worth timing for GEMMs of m rows (the Triton autotuner's `prune_configs_by`, as vLLM
    and SGLang prune): row tiles no taller than the bucket needs, and for large M none of the short ones
    that re-read the weights every 16 or 32 rows. Halves the sweep (56 timings over the 13 buckets, not 117)."""
    b = m_bucket(m)
    top, low = max(16, min(128, b)), 16 if b <= 64 else 32 if b <= 256 else 64
    return [c for c in _CONFIGS if low <= c.kwargs["BLOCK_M"] <= top]


_DEFAULT_TILES = {16: (16, 64, 4, 6), 32: (32, 64, 4, 6), 128: (64, 64, 4, 5), M_BUCKET_MAX: (64, 128, 4, 3)}


def default_config(m: int, block_m: int | None = None) -> triton.Config:
    """The tile config of a shape no table answers: by bucket of M, the tile most often tuned fastest on
    Hopper for that class; with a fixed row tile, that tile's config of BLOCK_N 128."""
    if block_m is not None:
        fits = [c for c in _CONFIGS if c.kwargs["BLOCK_M"] == block_m]
        return next((c for c in fits if c.kwargs["BLOCK_N"] == 128), fits[0])
    b = m_bucket(m)
    bm, bn, warps, stages = next(t for top, t in _DEFAULT_TILES.items() if b <= top)
    return next(
        c for c in _CONFIGS
        if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == (bm, bn, warps, stages)
    )  # fmt: skip


def tuning_key(
    layout: int, m: int, n: int, k: int, experts: int, block_m: int | None = None
) -> tuple[int, ...]:
    """The key of every kernel choice for a GEMM shape: M by its bucket; a fixed row tile (the contiguous
    layout's padding) appended."""
    key = (layout, m_bucket(m), n, k, experts)
    return key if block_m is None else (*key, block_m)


def _tunable(layout: int, block_m: int | None) -> bool:
    """Dense and masked GEMMs tune their whole tile; the contiguous layout (prefill's MoE, ~60% of a V3
    prefill's FLOPs) tunes all but the row tile, which its per-expert padding fixes. A dense or masked call
    that names its block_m keeps the untuned kernel."""
    return _on_gpu() and (block_m is None or layout == CONTIGUOUS)


def _triton_candidates(m: int, block_m: int | None) -> list[triton.Config]:
    return configs_for(m) if block_m is None else [c for c in _CONFIGS if c.kwargs["BLOCK_M"] == block_m]


def _default_block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _launch(a, a_s, w, w_s, out, m, counts, tile_expert, layout, grid_e, block_m=None):
    """Strides are given for 3-D (expert-major) tensors; 2-D ones are viewed with one expert."""
    a3, s3, w3, ws3, c3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (a, a_s, w, w_s, out))
    if _tunable(layout, block_m):
        choice = _choose(layout, a3, s3, w3, ws3, c3, m, counts, tile_expert, grid_e, block_m)
        if choice is not None:  # the table's Gluon WGMMA config for this shape
            _launch_sm90(a3, s3, w3, ws3, c3, m, counts, tile_expert, layout, grid_e, choice)
            return
    _launch_triton(a3, s3, w3, ws3, c3, m, counts, tile_expert, layout, grid_e, block_m)


def _launch_triton(a3, s3, w3, ws3, c3, m, counts, tile_expert, layout, grid_e, block_m):
    n, k = w3.shape[1], w3.shape[2]
    per_expert_rows = layout == MASKED  # contiguous: rows are global, only the weight is per expert
    a_es, s_es, c_es = (t.stride(0) if per_expert_rows else 0 for t in (a3, s3, c3))
    args = (
        a3, s3, w3, ws3, c3, m, n, k, counts, tile_expert,
        a_es, a3.stride(1), s_es, s3.stride(1), s3.stride(2),
        w3.stride(0), w3.stride(1), ws3.stride(0), ws3.stride(1), ws3.stride(2),
        c_es, c3.stride(1),
    )  # fmt: skip
    candidates = _triton_candidates(m, block_m) if _tunable(layout, block_m) else []
    if candidates:

        def run(cfg: triton.Config) -> None:
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            _fp8_gemm_body[(triton.cdiv(m, bm) * triton.cdiv(n, bn), grid_e)](
                *args, LAYOUT=layout, BLOCK_K=GROUP, **cfg.kwargs, GROUP_M=group_m_for(bm),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip

        key = tuning_key(layout, m, n, k, grid_e, block_m)
        default = default_config(m, block_m)
        run(gemm_tuning.choose(_TRITON_CONFIG, key, candidates, run, table="triton_config", default=default,
                               output=c3))  # fmt: skip
    else:
        bm = block_m or _default_block_m(m)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, 128), grid_e)
        _fp8_gemm_body[grid](
            *args, LAYOUT=layout, BLOCK_M=bm, BLOCK_N=128, BLOCK_K=GROUP, GROUP_M=group_m_for(bm), num_warps=4
        )


def _launch_sm90(a3, s3, w3, ws3, c3, m, counts, tile_expert, layout, grid_e, cfg, split_k=1):
    """cfg: a `fp8_gemm_sm90.CONFIGS` entry."""
    from libs.kernels import fp8_gemm_sm90

    e, n, k = w3.shape
    a2 = a3.reshape(-1, k)  # masked: experts' row blocks stacked, addressed as e * m_max + row
    fp8_gemm_sm90.launch(
        a2, s3, w3.reshape(e * n, k), ws3, c3, m, n, k, counts, tile_expert, layout, grid_e, cfg,
        a_rows_per_expert=a3.shape[1], split_k=split_k, group_m=group_m_for(cfg[0]),
    )  # fmt: skip


# (layout, m bucket, n, k, experts[, block_m]) -> the chosen Gluon config, or None for the Triton kernel
_KERNEL_CHOICE: dict[tuple, tuple | None] = {}


def _sm90_candidates(layout, a3, w3, k_blocks) -> list[tuple]:
    from libs.kernels import fp8_gemm_sm90

    if not fp8_gemm_sm90.available(a3.device) or not (a3.is_contiguous() and w3.is_contiguous()):
        return []
    n = w3.shape[1]
    return [c for c in fp8_gemm_sm90.CONFIGS if k_blocks % c[4] == 0 and (layout == DENSE or n % c[1] == 0)]


def _choose(layout, a3, s3, w3, ws3, c3, m, counts, tile_expert, grid_e, block_m=None):
    """The Triton kernel (the default) or the table's Gluon config for this shape's bucket; everything but
    SM90 keeps the Triton kernel. A fixed block_m admits only the Gluon configs of that row tile."""
    key = tuning_key(layout, m, w3.shape[1], w3.shape[2], grid_e, block_m)
    if key not in _KERNEL_CHOICE:
        cands = _sm90_candidates(layout, a3, w3, w3.shape[2] // GROUP)
        cands = [c for c in cands if block_m is None or c[0] == block_m]
        if not cands:
            _KERNEL_CHOICE[key] = None
            return None

        def run(cfg):
            if cfg is None:
                _launch_triton(a3, s3, w3, ws3, c3, m, counts, tile_expert, layout, grid_e, block_m)
            else:
                _launch_sm90(a3, s3, w3, ws3, c3, m, counts, tile_expert, layout, grid_e, cfg)

        gemm_tuning.choose(_KERNEL_CHOICE, key, [None, *cands], run, table="kernel_choice", default=None, output=c3)
    return _KERNEL_CHOICE[key]


def _check_weight(w: torch.Tensor, w_s: torch.Tensor, k: int) -> None:
    if w.dtype != FP8 or w.shape[-1] != k or k % GROUP:
        raise ValueError(
            f"weight must be float8_e4m3fn [.., N, {k}] with K a multiple of {GROUP}, got {w.dtype} {tuple(w.shape)}"
        )
    if w_s.shape[-2:] != (triton.cdiv(w.shape[-2], GROUP), k // GROUP):
        raise ValueError(f"weight scale shape {tuple(w_s.shape)} does not match weight {tuple(w.shape)}")


NUM_SMS = 132  # H100 / H200 SXM: the split-K heuristic's target


def split_k_for(m: int, n: int, k: int) -> int:
    """Decode-sized dense GEMMs make too few 64x128 tiles to keep 132 SMs busy through a long K loop
    (one tile per SM leaves most of each SM idle); split K until ~4 tiles per SM."""
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
    return max(1, min(triton.cdiv(4 * NUM_SMS, tiles), k // GROUP // 4))


_SPLIT_CHOICE: dict[tuple, int] = {}  # tuning_key of the dense GEMM -> split-K factor


def _split_choice(xq, xs, w, w_s, out) -> int:
    """Split-K helps some decode shapes and hurts others (zero-fill, the planes' sum): the candidates are no
    split, `split_k_for`'s split (the default) and the splits up to twice it that divide the K blocks evenly
    (the only ones the Gluon kernel takes); the table picks among them per bucket of M."""
    m, k = xq.shape
    key = ("split", *tuning_key(DENSE, m, w.shape[0], k, 1))
    if key not in _SPLIT_CHOICE:
        target = split_k_for(m, w.shape[0], k)
        if target == 1:
            _SPLIT_CHOICE[key] = 1
        else:
            k_blocks = k // GROUP
            splits = sorted(
                {target} | {s for s in range(2, 2 * target + 1) if k_blocks % s == 0 and k_blocks // s >= 2}
            )

            def run(s: int) -> None:
                if s == 1:
                    fp8_gemm(xq, xs, w, w_s, out=out, split_k=1)
                else:
                    _fp8_gemm_split_k(xq, xs, w, w_s, out, s)

            gemm_tuning.choose(_SPLIT_CHOICE, key, [1, *splits[:6]], run, table="split_k", default=target, output=out)
    return _SPLIT_CHOICE[key]


def _fp8_gemm_split_k(xq, xs, w, w_s, out, split: int) -> None:
    """K in `split` slices, each program writing its slice's fp32 partial to its own plane, the planes summed
    by torch in a fixed order: deterministic, where atomic adds into one fp32 C summed three or more slices
    in whatever order they finished (greedy tokens then differed run to run on near-tied logits)."""
    m, k = xq.shape
    n = w.shape[0]
    acc = torch.empty(split, m, n, dtype=torch.float32, device=xq.device)  # every element written
    cfg = _split_sm90_config(xq, w, split)
    if cfg is not None:
        _launch_sm90(xq[None], xs[None], w[None], w_s[None], acc, m, xs, xs, DENSE, 1, cfg, split_k=split)
        torch.sum(acc, 0, out=out) if out.dtype == torch.float32 else out.copy_(acc.sum(0))
        return
    grid = (triton.cdiv(m, 64) * triton.cdiv(n, 128), 1, split)
    _fp8_gemm_body[grid](
        xq, xs, w, w_s, acc, m, n, k, xs, xs,
        0, xq.stride(0), 0, xs.stride(0), xs.stride(1), 0, w.stride(0), 0, w_s.stride(0), w_s.stride(1),
        acc.stride(0), acc.stride(1), LAYOUT=DENSE, BLOCK_M=64, BLOCK_N=128, BLOCK_K=GROUP, SPLIT_K=split,
        GROUP_M=group_m_for(64), num_warps=4, num_stages=4,
    )  # fmt: skip
    torch.sum(acc, 0, out=out) if out.dtype == torch.float32 else out.copy_(acc.sum(0))


def _split_sm90_config(xq, w, split: int):
    """Split-K slices of the Gluon kernel: 64x128 tiles, unrolled by 4 when every slice's K blocks allow."""
    if not _on_gpu():
        return None
    from libs.kernels import fp8_gemm_sm90

    k_blocks = xq.shape[1] // GROUP
    if not fp8_gemm_sm90.available(xq.device) or k_blocks % split:
        return None
    return (64, 128, 4, 4, 4) if (k_blocks // split) % 4 == 0 else (64, 128, 4, 4, 1)


def fp8_gemm(xq, xs, w, w_s, out_dtype=torch.bfloat16, out=None, block_m=None, split_k=None) -> torch.Tensor:
    """Dense: xq [M, K] fp8, xs [M, K/128] f32, w [N, K] fp8, w_s [N/128, K/128] f32 -> [M, N].

    split_k: None picks by shape on the GPU (1 under the interpreter); > 1 forces that many K slices."""
    m, k = xq.shape
    _check_weight(w, w_s, k)
    out = out if out is not None else torch.empty(m, w.shape[0], dtype=out_dtype, device=xq.device)
    if split_k is None:
        split_k = _split_choice(xq, xs, w, w_s, out) if _on_gpu() and block_m is None else 1
    if split_k > 1:
        _fp8_gemm_split_k(xq, xs, w, w_s, out, split_k)
        return out
    _launch(xq, xs, w, w_s, out, m, xs, xs, DENSE, 1, block_m)
    return out


def fp8_gemm_masked(xq, xs, w, w_s, counts, out_dtype=torch.bfloat16, out=None, block_m=None) -> torch.Tensor:
    """Masked grouped: xq [E, M_max, K], xs [E, M_max, K/128], w [E, N, K], w_s [E, N/128, K/128],
    counts [E] int32 -> [E, M_max, N]; rows at or past counts[e] are left unwritten."""
    e, m_max, k = xq.shape
    _check_weight(w, w_s, k)
    if w.shape[0] != e or counts.shape != (e,):
        raise ValueError(
            f"{e} expert row blocks need {e} weights and counts, got {w.shape[0]} and {tuple(counts.shape)}"
        )
    out = out if out is not None else torch.empty(e, m_max, w.shape[1], dtype=out_dtype, device=xq.device)
    _launch(xq, xs, w, w_s, out, m_max, counts, counts, MASKED, e, block_m)
    return out


def fp8_gemm_contiguous(xq, xs, w, w_s, tile_expert, block_m, out_dtype=torch.bfloat16, out=None):
    """Contiguous grouped: rows sorted by expert, each run padded to `block_m`; tile_expert [M/block_m]
    int32 names the expert of each row tile (-1: padding tile, skipped) -> [M, N]."""
    m, k = xq.shape
    _check_weight(w, w_s, k)
    if m % block_m or tile_expert.shape != (m // block_m,):
        raise ValueError(f"contiguous layout needs M ({m}) a multiple of block_m and one expert per tile")
    out = out if out is not None else torch.empty(m, w.shape[1], dtype=out_dtype, device=xq.device)
    _launch(
        xq.unsqueeze(0),
        xs.unsqueeze(0),
        w,
        w_s,
        out.unsqueeze(0),
        m,
        tile_expert,
        tile_expert,
        CONTIGUOUS,
        1,
        block_m,
    )
    return out


def fp8_gemm_reference(xq, xs, w, w_s, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Dequantize both sides in float32 and multiply: the oracle for all three layouts."""
    x = dequantize_fp8_groups(xq, xs)
    wf = dequant_blocks(w, w_s)
    return (x @ wf.transpose(-1, -2)).to(out_dtype)


def dequant_blocks(w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    n, k = w.shape[-2:]
    s = w_s.repeat_interleave(GROUP, -2)[..., :n, :].repeat_interleave(GROUP, -1)
    return w.float() * s
