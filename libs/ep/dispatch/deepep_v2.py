"""DeepEP V2 backend (`deep_ep.EPBuffer`, e.g. PyPI's `deepinfer-ep`), where V1's `deep_ep.Buffer` is not
available: one dispatch/combine for prefill and decode, in base.py's "tokens" layout with exact receive
counts. `mode` is accepted for parity with deepep.py and does not change the kernels."""

# The non-expanded layout with do_cpu_sync=True. FP8 dispatch sends base.py's 1x128 format as (fp8, scales);
# combine is BF16. The buffer is built at the first round (every rank reaches it in the same round: the
# header exchange comes first), sized for `max_tokens` tokens per rank and the round's top-k.

from __future__ import annotations

from typing import Any

import torch

from libs.ep.comm import Comm
from libs.ep.dispatch.base import Dispatched, Dispatcher, peak_tokens, quantize_for_dispatch
from libs.quant.fp8 import dequantize_fp8_groups

DEFAULT_MAX_TOKENS = 4096  # tokens per rank per round (a prefill chunk), unless `max_tokens` says otherwise


class DeepEPV2Dispatcher(Dispatcher):
    def __init__(
        self, group: Any, header: Comm, num_physical: int, hidden: int, dtype: torch.dtype,
        fp8: bool = True, mode: str = "auto", max_tokens: int = DEFAULT_MAX_TOKENS, **_: Any,
    ) -> None:  # fmt: skip
        import deep_ep

        if max_tokens < 1:
            raise ValueError(f"DeepEP max_tokens must be >= 1, got {max_tokens}")
        self.ep_buffer_class = deep_ep.EPBuffer
        self.idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)  # built with 32- or 64-bit ids
        self.group, self.header, self.num_physical, self.hidden = group, header, num_physical, hidden
        self.fp8, self.max_tokens, self.mode = fp8, max_tokens, mode
        self.buffer: Any = None

    def _buffer(self, top_k: int) -> Any:
        if self.buffer is None:  # collective: every rank is in this round
            self.buffer = self.ep_buffer_class(
                self.group, num_max_tokens_per_rank=self.max_tokens, hidden=self.hidden, num_topk=top_k,
                use_fp8_dispatch=self.fp8,
            )  # fmt: skip
        return self.buffer

    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None:
        peak = peak_tokens(self.header, active, x.shape[0])
        if peak is None:
            return None
        if peak > self.max_tokens:
            raise RuntimeError(
                f"{peak} tokens on one rank exceed the DeepEP buffer's {self.max_tokens} (max_tokens)"
            )
        buf = self._buffer(slots.shape[1])
        payload = quantize_for_dispatch(x) if self.fp8 else x.to(torch.bfloat16).contiguous()
        recv, recv_ids, recv_w, handle, _ = buf.dispatch(
            payload, topk_idx=slots.to(self.idx_dtype).contiguous(), topk_weights=weights.float().contiguous(),
            num_experts=self.num_physical, num_max_tokens_per_rank=self.max_tokens, do_cpu_sync=True,
        )  # fmt: skip
        rx = dequantize_fp8_groups(recv[0], recv[1], x.dtype) if self.fp8 else recv.to(x.dtype)
        return Dispatched("tokens", rx, recv_ids.long(), recv_w, handle=(handle, x.dtype))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        handle, dtype = d.handle
        out, _, _ = self.buffer.combine(y.to(torch.bfloat16).contiguous(), handle)
        return out.to(dtype)
