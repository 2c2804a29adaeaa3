"""`EngineArgs`: every knob of an engine (plain, MTP, EP group, timing model), each default written once here.
Engines take one plus keyword overrides of its fields (`with_overrides`); the worker builds one from its
settings (libs/worker/startup.engine_args). Frozen, so one value can be handed to every EP rank as is."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "fp8", "none")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
EP_BACKENDS = ("auto", "fixed", "torch", "deepep", "mooncake")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")

_MINIMUM = {
    "page_size": 1, "num_pages": 0, "max_num_seqs": 1, "max_prefill_tokens": 1, "torch_threads": 0,
    "mtp_k": 0, "ep_size": 1, "ep_redundant_experts": 0, "eplb_interval_steps": 0, "host_kv_pages": 0,
}  # fmt: skip
_CHOICES = {
    "dtype": DTYPES, "quantization": QUANTIZATIONS, "attention_backend": ATTENTION_BACKENDS,
    "ep_backend": EP_BACKENDS, "kv_cache_dtype": KV_CACHE_DTYPES,
}  # fmt: skip
_BOOLS = ("enable_prefix_cache", "cuda_graphs", "overlap", "two_batch_overlap", "ep_fp8_dispatch")


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class EngineArgs(msgspec.Struct, frozen=True, kw_only=True):
    # KV pool and batching (under EP: per rank)
    page_size: Annotated[int, _doc("tokens per KV page")] = 16
    num_pages: Annotated[int, _doc("KV pages in the pool; 0: the engine's default (default_num_pages)")] = 0
    max_num_seqs: Annotated[int, _doc("most sequences in one running batch")] = 64
    max_prefill_tokens: Annotated[int, _doc("most prompt tokens in one forward (chunked prefill)")] = 2048
    enable_prefix_cache: Annotated[bool, _doc("reuse cached KV pages of shared prompt prefixes")] = True
    host_kv_pages: Annotated[
        int, _doc("host-memory KV tier under the prefix cache, in pages (evicted pages go there); 0: by GiB")
    ] = 0
    host_kv_cache_gb: Annotated[
        float, _doc("host-memory tier in GiB, when host_kv_pages is 0; 0 and 0: no host tier")
    ] = 0.0
    kv_cache_dtype: Annotated[
        str, _doc("latent KV cache: auto (the model dtype) or fp8_e4m3 (FP8 rows: one scale for the tensor with "
                  "attention_backend flashinfer, a scale per token otherwise)")
    ] = "auto"
    # model and device
    device: Annotated[str, _doc("cpu, cuda or cuda:N (EP ranks: cpu, or cuda, rank r on cuda:r)")] = "cpu"
    dtype: Annotated[str, _doc("auto (bfloat16 on CUDA, float32 on CPU), float32, ...")] = "auto"
    quantization: Annotated[str, _doc("FP8 checkpoints: auto (FP8 on CUDA), fp8 or none")] = "auto"
    attention_backend: Annotated[str, _doc("auto, torch, triton or flashinfer (EP ranks use auto)")] = "auto"
    torch_threads: Annotated[int, _doc("torch intra-op threads of an engine process on CPU; 0: torch's")] = 1
    # the decode step
    cuda_graphs: Annotated[bool, _doc("run decode steps as CUDA graphs where the model allows it")] = True
    fast_path: Annotated[bool | None, _doc("the fused decoder path; None: on CUDA")] = None
    overlap: Annotated[bool, _doc("decode graphs run a step ahead of the host")] = True
    two_batch_overlap: Annotated[bool, _doc("every forward as two overlapped micro-batches")] = False
    mtp_k: Annotated[int, _doc("MTP speculative decoding: draft tokens per step; 0: off")] = 0
    # expert parallelism (EPEngine)
    ep_size: Annotated[int, _doc("EP rank processes, each with 1/ep_size of the routed experts")] = 1
    ep_backend: Annotated[str, _doc("EP dispatch/combine: auto, fixed, torch, deepep or mooncake")] = "auto"
    ep_redundant_experts: Annotated[int, _doc("extra physical expert slots for EPLB")] = 0
    ep_fp8_dispatch: Annotated[bool, _doc("send dispatched tokens in FP8")] = False
    eplb_interval_steps: Annotated[int, _doc("rebalance experts every N steps; 0: never")] = 0
    ep_timeout_s: Annotated[float, _doc("seconds the front waits for a rank's answer or start")] = 300.0
    ep_kv_transfer: Annotated[
        tuple[str, str, str] | None,
        _doc("(protocol, hostname, device): each EP rank registers its own KV pool; None: one shared pool"),
    ] = None

    def __post_init__(self) -> None:
        for name, low in _MINIMUM.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.fast_path not in (None, True, False):
            raise ValueError(f"fast_path must be true, false or None, got {self.fast_path!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not isinstance(self.ep_timeout_s, (int, float)) or not self.ep_timeout_s > 0:
            raise ValueError(f"ep_timeout_s must be a number > 0, got {self.ep_timeout_s!r}")
        kv = self.ep_kv_transfer
        if kv is not None and (len(kv) != 3 or not all(isinstance(x, str) for x in kv)):
            raise ValueError(f"ep_kv_transfer must be (protocol, hostname, device) or None, got {kv!r}")
        if self.two_batch_overlap and self.mtp_k:
            raise ValueError("two_batch_overlap does not run with MTP (mtp_k)")
        if not isinstance(self.host_kv_cache_gb, (int, float)) or not 0 <= self.host_kv_cache_gb < 1 << 20:
            raise ValueError(f"host_kv_cache_gb must be a number >= 0, got {self.host_kv_cache_gb!r}")
        if self.host_tier and (self.mtp_k or self.ep_size > 1 or not self.enable_prefix_cache):
            raise ValueError("the host KV tier runs under the prefix cache of one rank, without MTP")

    @property
    def host_tier(self) -> bool:
        return self.host_kv_pages > 0 or self.host_kv_cache_gb > 0

    @property
    def resolved_dtype(self) -> str:
        """dtype with auto resolved: 16-bit activations on a GPU, float32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


DEFAULTS = EngineArgs()


def with_overrides(args: EngineArgs | None, overrides: dict[str, Any]) -> EngineArgs:
    """`args` (None: the defaults) with some fields replaced; TypeError names an unknown field."""
    base = DEFAULTS if args is None else args
    unknown = sorted(set(overrides) - set(EngineArgs.__struct_fields__))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}: see EngineArgs")
    return msgspec.structs.replace(base, **overrides) if overrides else base
