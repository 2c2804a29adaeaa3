"""One-GPU check of a built deep_ep (scripts/build_deep_ep.sh): import, then a one-rank Buffer round trip in
normal mode (get_dispatch_layout -> dispatch -> combine, BF16 and FP8) and in low-latency mode
(low_latency_dispatch -> low_latency_combine), each result checked against what one rank must get back;
for a DeepEP V2 build (EPBuffer, no Buffer), its dispatch -> combine in BF16 and FP8 instead.
Writes $OUT/deep_ep_check.json; every step records its own error, so one failure leaves the others' results.

    PYTHONPATH=/tmp/site python3 scripts/check_deep_ep.py

Needs torch and deep_ep only (no moemesh package), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TOKENS, HIDDEN, EXPERTS, TOPK = 64, 7168, 32, 8  # DeepSeek-V3's hidden; LL kernels support a few hiddens
FP8_GROUP = 128


def _step(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as e:  # noqa: BLE001 (each step reports its own failure)
        results[name] = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-2000:],
        }
    results[name]["seconds"] = round(time.perf_counter() - t0, 3)
    print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"}), flush=True)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    topk = (
        torch.rand(TOKENS, EXPERTS, device="cuda", generator=g).topk(TOPK, dim=1).indices
    )  # distinct experts
    weights = torch.rand(TOKENS, TOPK, device="cuda", generator=g)
    return x, topk.to(torch.int64), weights / weights.sum(1, keepdim=True)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = x.float().unflatten(-1, (-1, FP8_GROUP))
    s = g.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (g / s.unsqueeze(-1)).flatten(-2).to(torch.float8_e4m3fn), s


def _dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, FP8_GROUP)) * s.float().unsqueeze(-1)).flatten(-2)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def normal_round_trip(deep_ep: Any, group: Any, fp8: bool) -> dict[str, Any]:
    buf_cls = deep_ep.Buffer
    hidden_bytes = HIDDEN * 2
    nvl = max(
        c.get_nvl_buffer_size_hint(hidden_bytes, 1)
        for c in (buf_cls.get_dispatch_config(1), buf_cls.get_combine_config(1))
    )
    buf = buf_cls(group, nvl, 0)
    x, topk, weights = _inputs(1)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, EXPERTS)
    payload = _quantize(x) if fp8 else x
    recv, recv_topk, recv_w, counts, handle, _ = buf.dispatch(
        payload, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
    )  # fmt: skip
    rx = _dequantize(*recv) if fp8 else recv.float()
    want = _dequantize(*payload) if fp8 else x.float()
    # one rank: every token arrives once, in order, with its own experts and weights
    assert rx.shape == (TOKENS, HIDDEN), rx.shape
    assert torch.equal(recv_topk, topk), "received top-k ids differ"
    assert torch.allclose(recv_w, weights), "received weights differ"
    assert list(counts) == torch.bincount(topk.flatten(), minlength=EXPERTS).tolist(), counts
    dispatch_err = _max_err(rx, want)
    assert dispatch_err == 0.0, f"dispatch changed the bytes: {dispatch_err}"
    out, _, _ = buf.combine(rx.to(torch.bfloat16), handle)  # one rank: the sum over ranks is the row itself
    combine_err = _max_err(out, rx.to(torch.bfloat16))
    assert combine_err == 0.0, f"combine changed the rows: {combine_err}"
    return {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "nvl_bytes": nvl}


def low_latency_round_trip(deep_ep: Any, group: Any) -> dict[str, Any]:
    buf_cls = deep_ep.Buffer
    cap = 128
    rdma = buf_cls.get_low_latency_rdma_size_hint(cap, HIDDEN, 1, EXPERTS)
    buf = buf_cls(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=EXPERTS)
    x, topk, weights = _inputs(2)
    has_fp8_flag = "use_fp8" in inspect.signature(buf.low_latency_dispatch).parameters
    kwargs = {"use_fp8": True} if has_fp8_flag else {}
    recv, counts, handle, _, _ = buf.low_latency_dispatch(x, topk, cap, EXPERTS, **kwargs)
    rx = _dequantize(recv[0], recv[1])  # [E, cap * ranks, D]
    counts_l = counts.tolist()
    assert counts_l == torch.bincount(topk.flatten(), minlength=EXPERTS).tolist(), counts_l
    src = handle[0]  # [E, cap * ranks] int32: source token of each received row
    want = _dequantize(*_quantize(x))
    worst = 0.0
    for e, n in enumerate(counts_l):
        rows = src[e, :n].long() % cap  # low 32 bits hold the token index on its rank
        assert sorted(rows.tolist()) == (topk == e).any(1).nonzero().flatten().tolist(), f"expert {e} rows"
        worst = max(worst, _max_err(rx[e, :n], want[rows]))
    y = rx.to(torch.bfloat16)  # identity experts: combine returns sum_k w_k * x
    out, _, _ = buf.low_latency_combine(y, topk, weights, handle)
    combine_err = _max_err(out, want * weights.sum(1, keepdim=True))
    assert worst < 0.1 and combine_err < 0.1, (worst, combine_err)
    return {"cap": cap, "rdma_bytes": rdma, "dispatch_max_err": worst, "combine_max_err": combine_err,
            "use_fp8_argument": has_fp8_flag}  # fmt: skip


def v2_round_trip(deep_ep: Any, group: Any, fp8: bool) -> dict[str, Any]:
    """DeepEP V2's EPBuffer (non-expanded layout, exact counts): one rank gets every token back, in order."""
    buf = deep_ep.EPBuffer(
        group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK, use_fp8_dispatch=fp8
    )
    x, topk, weights = _inputs(3)
    topk = topk.to(getattr(deep_ep, "topk_idx_t", torch.int64))
    payload = _quantize(x) if fp8 else x
    recv, recv_topk, recv_w, handle, _ = buf.dispatch(
        payload, topk_idx=topk, topk_weights=weights, num_experts=EXPERTS, num_max_tokens_per_rank=TOKENS,
        do_cpu_sync=True,
    )  # fmt: skip
    rx = _dequantize(*recv) if fp8 else recv.float()
    want = _dequantize(*payload) if fp8 else x.float()
    assert rx.shape == (TOKENS, HIDDEN), rx.shape
    assert torch.equal(recv_topk.long(), topk.long()), "received top-k ids differ"
    assert torch.allclose(recv_w, weights), "received weights differ"
    dispatch_err = _max_err(rx, want)
    assert dispatch_err == 0.0, f"dispatch changed the bytes: {dispatch_err}"
    out, _, _ = buf.combine(rx.to(torch.bfloat16), handle)
    combine_err = _max_err(out, rx.to(torch.bfloat16))
    assert combine_err == 0.0, f"combine changed the rows: {combine_err}"
    return {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "num_bytes": buf.num_bytes}


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/deep_ep_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "none",
        "torch": torch.__version__,
    }
    try:
        import deep_ep
    except Exception as e:  # noqa: BLE001
        results["import"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        (out_dir / "deep_ep_check.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(results))
        return
    api = (
        "v1 (Buffer)"
        if hasattr(deep_ep, "Buffer")
        else "v2 (EPBuffer)"
        if hasattr(deep_ep, "EPBuffer")
        else "?"
    )
    results["import"] = {
        "ok": True,
        "file": deep_ep.__file__,
        "version": getattr(deep_ep, "__version__", "?"),
        "api": api,
    }
    if not cuda:
        results["round_trips"] = "skipped: no CUDA device"
        (out_dir / "deep_ep_check.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(results))
        return
    torch.cuda.set_device(0)
    store = tempfile.mkdtemp(prefix="deep_ep_check-")
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
    group = dist.new_group([0])
    if hasattr(deep_ep, "Buffer"):
        _step(results, "normal_bf16", lambda: normal_round_trip(deep_ep, group, fp8=False))
        _step(results, "normal_fp8", lambda: normal_round_trip(deep_ep, group, fp8=True))
        _step(results, "low_latency", lambda: low_latency_round_trip(deep_ep, group))
    elif hasattr(deep_ep, "EPBuffer"):
        _step(results, "v2_bf16", lambda: v2_round_trip(deep_ep, group, fp8=False))
        _step(results, "v2_fp8", lambda: v2_round_trip(deep_ep, group, fp8=True))
    dist.destroy_process_group()
    (out_dir / "deep_ep_check.json").write_text(json.dumps(results, indent=1))
    print(
        json.dumps(
            {
                k: (v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "trace"})
                for k, v in results.items()
            }
        )
    )


if __name__ == "__main__":
    main()
