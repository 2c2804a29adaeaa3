"""DeepEP V1 backend (`deep_ep.Buffer`): the normal kernels ("tokens" layout) for prefill-sized rounds, the
low-latency kernels ("experts" layout) when the largest token count of any rank fits `ll_max_tokens`, chosen
per round from the exchanged header so every rank launches the same collective. What ran where: NOTES-ep.md."""

# Written against DeepEP's documented Python API (get_dispatch_layout / dispatch / combine,
# low_latency_dispatch / low_latency_combine, the buffer size hints). FP8 dispatch uses DeepEP's per-128
# scales; combine is BF16. Two buffers (normal, low-latency), so switching modes needs no buffer cleaning.
# PyPI's deep-ep 1.0.0's low_latency_dispatch always casts to FP8; later V1 releases take `use_fp8`, passed
# when present. scripts/build_deep_ep.sh builds it; DeepEP V2 (`EPBuffer`) goes through deepep_v2.py.

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any

import torch

from libs.ep.comm import Comm
from libs.ep.dispatch.base import Dispatched, Dispatcher, peak_tokens, quantize_for_dispatch
from libs.quant.fp8 import dequantize_fp8_groups

MODES = ("auto", "normal", "low_latency")


class DeepEPDispatcher(Dispatcher):
    def __init__(
        self, group: Any, header: Comm, num_physical: int, hidden: int, dtype: torch.dtype,
        fp8: bool = True, mode: str = "auto", ll_max_tokens: int = 128,
    ) -> None:  # fmt: skip
        if mode not in MODES:
            raise ValueError(f"DeepEP mode must be one of {MODES}, got {mode!r}")
        if fp8 and hidden % 128:
            raise ValueError(f"DeepEP FP8 dispatch needs hidden a multiple of 128, got {hidden}")
        Buffer = load_buffer_class()
        n = header.size
        self.header, self.num_physical, self.fp8, self.ll_max_tokens = (
            header,
            num_physical,
            fp8,
            ll_max_tokens,
        )
        self.normal = self.ll = None
        if mode != "low_latency":
            hidden_bytes = hidden * 2  # sized for BF16 rows, which also covers FP8 + scales
            nvl = rdma = 0
            for config in (Buffer.get_dispatch_config(n), Buffer.get_combine_config(n)):
                nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, n))
                rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, n))
            self.normal = Buffer(group, nvl, rdma)
        if mode != "normal":
            rdma = Buffer.get_low_latency_rdma_size_hint(ll_max_tokens, hidden, n, num_physical)
            self.ll = Buffer(
                group, 0, rdma, low_latency_mode=True, num_qps_per_rank=max(1, num_physical // n)
            )
            params = inspect.signature(self.ll.low_latency_dispatch).parameters
            self.ll_kwargs, self.ll_fp8 = ll_dispatch_options(params, fp8)

    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None:
        peak = peak_tokens(self.header, active, x.shape[0])
        if peak is None:
            return None
        if pick_mode(peak, self.ll_max_tokens, self.normal is not None, self.ll is not None) == "low_latency":
            return self._dispatch_ll(x, slots, weights)
        return self._dispatch_normal(x, slots, weights)

    def _dispatch_normal(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        buf = self.normal
        assert buf is not None
        slots = slots.to(torch.int64).contiguous()  # DeepEP's topk_idx dtype
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(slots, self.num_physical)
        payload = quantize_for_dispatch(x) if self.fp8 else x.to(torch.bfloat16).contiguous()
        recv, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            payload, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=slots,
            topk_weights=weights.float(),
        )  # fmt: skip
        rx = dequantize_fp8_groups(recv[0], recv[1], x.dtype) if self.fp8 else recv.to(x.dtype)
        return Dispatched("tokens", rx, recv_ids, recv_w, handle=("normal", handle, x.dtype))

    def _dispatch_ll(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        assert self.ll is not None
        slots = slots.to(torch.int64).contiguous()
        recv, counts, handle, _, _ = self.ll.low_latency_dispatch(
            x.to(torch.bfloat16).contiguous(), slots, self.ll_max_tokens, self.num_physical, **self.ll_kwargs
        )
        rx = dequantize_fp8_groups(recv[0], recv[1], x.dtype) if self.ll_fp8 else recv.to(x.dtype)
        return Dispatched(
            "experts", rx, counts=counts.tolist(), handle=("ll", handle, slots, weights, x.dtype)
        )

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        if d.handle[0] == "normal":
            _, handle, dtype = d.handle
            assert self.normal is not None
            out, _, _ = self.normal.combine(y.to(torch.bfloat16), handle)
            return out.to(dtype)
        _, handle, slots, weights, dtype = d.handle
        assert self.ll is not None
        out, _, _ = self.ll.low_latency_combine(y.to(torch.bfloat16), slots, weights.float(), handle)
        return out.to(dtype)


def deepep_api() -> str:
    """ "v1" (deep_ep.Buffer), "v2" (deep_ep.EPBuffer only) or "none" (deep_ep does not import: the V1
    dispatcher then says why)."""
    try:
        import deep_ep
    except ImportError:
        return "none"
    return "v2" if not hasattr(deep_ep, "Buffer") and hasattr(deep_ep, "EPBuffer") else "v1"


def load_buffer_class() -> Any:
    """deep_ep.Buffer (DeepEP's V1 API), or a RuntimeError saying what is missing."""
    try:
        import deep_ep
    except ImportError as e:
        raise RuntimeError(
            "EP backend 'deepep' needs the deep_ep package (https://github.com/deepseek-ai/DeepEP) built "
            f"for this GPU and NVSHMEM (scripts/build_deep_ep.sh); it does not import here: {e}"
        ) from e
    buffer = getattr(deep_ep, "Buffer", None)
    if buffer is None:
        raise RuntimeError(
            f"DeepEPDispatcher speaks DeepEP's V1 API (deep_ep.Buffer); the deep_ep at {deep_ep.__file__} "
            f"(version {getattr(deep_ep, '__version__', '?')}) has none (make_dispatcher picks deepep_v2.py for V2)"
        )
    return buffer


def pick_mode(peak: int, ll_max_tokens: int, has_normal: bool, has_ll: bool) -> str:
    """The kernels every rank uses for a round whose largest per-rank token count is `peak`: low-latency
    when built and the round fits its buffers, else normal; a round that fits neither is an error."""
    if has_ll and peak <= ll_max_tokens:
        return "low_latency"
    if has_normal:
        return "normal"
    raise RuntimeError(
        f"{peak} tokens on one rank exceed DeepEP low-latency's {ll_max_tokens} and this dispatcher has no "
        "normal-mode buffer (mode='low_latency'): raise ll_max_tokens or use mode='auto'"
    )


def ll_dispatch_options(params: Collection[str], fp8: bool) -> tuple[dict[str, Any], bool]:
    """(keyword arguments for Buffer.low_latency_dispatch, whether it returns FP8 + scales) for a deep_ep
    whose low_latency_dispatch takes `params`: DeepEP 1.0.0 has no `use_fp8` and always casts to FP8."""
    if "use_fp8" in params:
        return {"use_fp8": fp8}, fp8
    return {}, True
