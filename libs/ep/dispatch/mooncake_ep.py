"""Mooncake EP backend (`mooncake.mooncake_ep_buffer.Buffer`: DeepEP-style low-latency kernels with per-rank
activity for fault tolerance), "experts" layout. No normal mode: every forward on every rank must fit
`max_tokens` (at most 1024), which EPEngine checks at start. What ran where: bench/NOTES-ep.md."""

# Follows Mooncake's documented Buffer API (dispatch / combine with active_ranks and timeout_us) as SGLang's
# Mooncake dispatcher uses it. Available when `mooncake.ep` imports (the CUDA wheel built with EP).

from __future__ import annotations

from typing import Any

import torch

from libs.ep.comm import Comm
from libs.ep.dispatch.base import Dispatched, Dispatcher, peak_tokens
from libs.quant.fp8 import dequantize_fp8_groups

MAX_TOKENS_LIMIT = 1024  # Mooncake EP's per-rank dispatch limit
DEFAULT_MAX_TOKENS = 128  # tokens per rank per forward unless the `max_tokens` option says otherwise


class MooncakeEPDispatcher(Dispatcher):
    def __init__(
        self, group: Any, header: Comm, num_physical: int, hidden: int, dtype: torch.dtype,
        fp8: bool = True, max_tokens: int = DEFAULT_MAX_TOKENS, timeout_us: int = 10_000_000,
    ) -> None:  # fmt: skip
        try:
            import mooncake.ep  # noqa: F401  (the EP extension; the Buffer module imports without it)
            from mooncake.mooncake_ep_buffer import Buffer
        except ImportError as e:
            raise RuntimeError(
                "EP backend 'mooncake' needs Mooncake built with EP (the CUDA wheel, WITH_EP=ON): "
                f"mooncake.ep does not import here: {e}"
            ) from e
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"Mooncake EP max_tokens must be in 1..{MAX_TOKENS_LIMIT}, got {max_tokens}")
        n = header.size
        self.header, self.num_physical, self.fp8 = header, num_physical, fp8
        self.max_tokens, self.timeout_us = max_tokens, timeout_us
        self.buffer = Buffer(group, Buffer.get_ep_buffer_size_hint(max_tokens, hidden, n, num_physical))
        self.active_ranks = torch.ones(
            n, dtype=torch.int32, device=torch.device("cuda", torch.cuda.current_device())
        )
        self.first = True  # the first call may wait for peers to connect: no timeout

    def _timeout(self) -> int:
        return -1 if self.first else self.timeout_us

    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, active: bool = True
    ) -> Dispatched | None:
        peak = peak_tokens(self.header, active, x.shape[0])
        if peak is None:
            return None
        if peak > self.max_tokens:
            raise RuntimeError(
                f"Mooncake EP is low-latency only: {peak} tokens in one forward on a rank, at most "
                f"{self.max_tokens} (keep max_prefill_tokens and max_num_seqs <= {self.max_tokens})"
            )
        recv, counts, handle, _, _ = self.buffer.dispatch(
            x.to(torch.bfloat16).contiguous(), slots.contiguous(), self.active_ranks, self.max_tokens,
            self.num_physical, self._timeout(), use_fp8=self.fp8,
        )  # fmt: skip
        rx = dequantize_fp8_groups(recv[0], recv[1], x.dtype) if self.fp8 else recv.to(x.dtype)
        return Dispatched("experts", rx, counts=counts.tolist(), handle=(handle, slots, weights, x.dtype))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        handle, slots, weights, dtype = d.handle
        out, _, _ = self.buffer.combine(
            y.to(torch.bfloat16), slots, weights.float(), self.active_ranks, self._timeout(), handle
        )
        self.first = False
        return out.to(dtype)
