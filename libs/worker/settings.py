"""Settings every worker service has (env prefix MOEMESH_PREFILL_WORKER_ / MOEMESH_DECODE_WORKER_)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

import msgspec

from libs.bus.settings import ServiceSettings
from libs.engine.args import DEFAULTS as _E  # the engine's defaults, written once there
from libs.engine.args import KV_CACHE_DTYPES


class WorkerSettings(ServiceSettings, frozen=True, kw_only=True):
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {  # vLLM's names for the same settings
        "page_size": ("block_size",),
        "max_prefill_tokens": ("max_num_batched_tokens",),
        "num_pages": ("num_gpu_blocks_override",),
        "enable_prefix_cache": ("enable_prefix_caching",),
        "mtp_k": ("num_speculative_tokens",),
    }

    model_dir: Annotated[str, msgspec.Meta(description="Hugging Face checkpoint folder (required)")] = ""
    served_model_name: Annotated[
        str, msgspec.Meta(description="the model name clients use; empty: the folder's name")
    ] = ""
    device: Annotated[str, msgspec.Meta(description="cpu, cuda or cuda:N")] = _E.device
    dtype: Annotated[
        str,
        msgspec.Meta(
            description="activation dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16"
        ),
    ] = _E.dtype
    quantization: Annotated[
        str,
        msgspec.Meta(description="FP8 checkpoints: auto (FP8 on CUDA), fp8, or none (dequantize to dtype)"),
    ] = _E.quantization
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1024, description="tokens per KV page")] = _E.page_size
    num_pages: Annotated[
        int, msgspec.Meta(ge=0, description="KV pages in the pool; 0: the engine's default")
    ] = _E.num_pages
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, description="most sequences in one running batch")] = (
        _E.max_num_seqs
    )
    max_prefill_tokens: Annotated[
        int, msgspec.Meta(ge=1, description="most prompt tokens in one forward (chunked prefill)")
    ] = _E.max_prefill_tokens
    enable_prefix_cache: Annotated[
        bool, msgspec.Meta(description="reuse cached KV pages of shared prompt prefixes")
    ] = _E.enable_prefix_cache
    kv_cache_dtype: Annotated[
        str,
        msgspec.Meta(
            description="latent KV cache: auto (the model dtype) or fp8_e4m3 (FP8 rows, about half the bytes: "
            "one scale for the tensor with attention_backend flashinfer, a scale per token otherwise); prefill and decode "
            "workers must agree, attention backend included"
        ),
    ] = _E.kv_cache_dtype
    host_kv_pages: Annotated[
        int,
        msgspec.Meta(
            ge=0, description="host-memory KV tier in pages: pages the prefix cache evicts are kept there "
            "(pinned RAM beside a GPU) and loaded back on a hit; 0: sized by host_kv_cache_gb",
        ),
    ] = _E.host_kv_pages
    host_kv_cache_gb: Annotated[
        float, msgspec.Meta(ge=0, description="host-memory KV tier in GiB when host_kv_pages is 0; 0: no host tier")
    ] = _E.host_kv_cache_gb
    kv_store_master: Annotated[
        str,
        msgspec.Meta(
            description="Mooncake Store master (host:port) of the KV tier shared by workers (needs the host "
            "tier); empty: off. `moemesh up --kv-store` starts one and sets it",
        ),
    ] = ""
    kv_store_segment_mb: Annotated[
        int, msgspec.Meta(ge=16, description="RAM this worker lends the shared KV store, MiB (Mooncake's segment)")
    ] = 256
    kv_store_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="a request waits at most this long for its shared-store lookup")
    ] = 1.0
    kv_store_retry_s: Annotated[
        float, msgspec.Meta(gt=0, description="after a store failure, seconds of recompute before trying it again")
    ] = 5.0
    kv_store_namespace: Annotated[
        str,
        msgspec.Meta(
            description="names this model's pages in the shared store; empty: a digest of the checkpoint, "
            "dtype and KV layout (workers must agree to share)",
        ),
    ] = ""
    attention_backend: Annotated[
        str,
        msgspec.Meta(
            description="auto, torch, triton or flashinfer (single-rank engines; EP ranks use auto)"
        ),
    ] = _E.attention_backend
    transfer_protocol: Annotated[
        str,
        msgspec.Meta(
            description="KV transfer: tcp, rdma, nvlink_intra, inprocess (tests) or skip (engine=sim)"
        ),
    ] = "tcp"
    transfer_hostname: Annotated[
        str, msgspec.Meta(description="address peers reach this worker's transfer engine at")
    ] = "127.0.0.1"
    transfer_device: Annotated[str, msgspec.Meta(description="RDMA device names, e.g. mlx5_0")] = ""
    torch_threads: Annotated[
        int, msgspec.Meta(ge=0, description="torch intra-op threads on CPU; 0: torch's default")
    ] = _E.torch_threads
    heartbeat_interval_ms: Annotated[
        int, msgspec.Meta(ge=10, description="milliseconds between heartbeats to the mesh")
    ] = 250
    stall_dump_s: Annotated[
        float,
        msgspec.Meta(
            ge=0, description="no heartbeat out for this long: every thread's stack to the log; 0: off"
        ),
    ] = 3.0
    gil_switch_interval_ms: Annotated[
        float,
        msgspec.Meta(
            gt=0, le=100, description="Python's GIL switch interval in this process (sys.setswitchinterval)"
        ),
    ] = 0.5
    broker_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="seconds to wait for the kv-broker's answer")
    ] = 5.0
    ep_size: Annotated[
        int,
        msgspec.Meta(
            ge=1, description="expert parallelism: rank processes, each with 1/ep_size of the routed experts"
        ),
    ] = _E.ep_size
    dp_size: Annotated[int, msgspec.Meta(ge=0, description="attention data-parallel ranks: 0 or ep_size")] = 0
    ep_backend: Annotated[
        str, msgspec.Meta(description="EP dispatch/combine: auto, fixed, torch, deepep or mooncake")
    ] = _E.ep_backend
    ep_redundant_experts: Annotated[
        int, msgspec.Meta(ge=0, description="extra physical expert slots for EPLB")
    ] = _E.ep_redundant_experts
    ep_fp8_dispatch: Annotated[bool, msgspec.Meta(description="send dispatched tokens in FP8")] = (
        _E.ep_fp8_dispatch
    )
    ep_kv_per_rank: Annotated[
        bool, msgspec.Meta(description="each EP rank registers its own KV pool (always on with a GPU device)")
    ] = False
    eplb_interval_steps: Annotated[
        int, msgspec.Meta(ge=0, description="rebalance experts every N steps; 0: never")
    ] = _E.eplb_interval_steps
    two_batch_overlap: Annotated[
        bool,
        msgspec.Meta(
            description="run each forward as two micro-batches, one's EP exchange overlapping the other's compute"
        ),
    ] = _E.two_batch_overlap
    engine: Annotated[
        str, msgspec.Meta(description="model (run the checkpoint) or sim (timing model of the forward pass)")
    ] = "model"
    sim_speed: Annotated[
        float, msgspec.Meta(gt=0, description="engine=sim: how much faster than the modeled GPU")
    ] = 1.0
    sim_prefill_ms_per_token: Annotated[
        float, msgspec.Meta(ge=0, description="engine=sim: prefill milliseconds per token")
    ] = 0.04
    sim_prefill_fixed_ms: Annotated[
        float, msgspec.Meta(ge=0, description="engine=sim: fixed milliseconds per prefill")
    ] = 5.0
    mtp_k: Annotated[
        int, msgspec.Meta(ge=0, le=8, description="MTP speculative decoding: draft tokens per step; 0: off")
    ] = _E.mtp_k
    warmup: Annotated[
        str, msgspec.Meta(description="warm-up before serving: auto (on for a model on CUDA), on or off")
    ] = "auto"
    # An engine thread's forwards free activation bursts into its own glibc arena, which keeps them (a CPU
    # decode worker prefilling long prompts while no prefill worker was up kept +50-80 MiB for good): the
    # main arena alone, trimmed every 30 s, hands them back.
    malloc_trim_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description="every this many seconds, return glibc's freed-but-kept heap to the OS (malloc_trim); "
            "0: off",
        ),
    ] = 30.0
    malloc_arena_max: Annotated[
        int,
        msgspec.Meta(
            ge=-1,
            description="glibc malloc arenas at most (mallopt M_ARENA_MAX, as MALLOC_ARENA_MAX); 0: glibc's "
            "default; -1 (auto): 1 on the CPU, where activations live in the heap, else glibc's default",
        ),
    ] = -1

    @property
    def kv_per_rank(self) -> bool:
        """EP ranks keep their own KV pools (rank_kv.py): asked for, or forced by pools on GPUs."""
        return self.ep_size > 1 and (self.ep_kv_per_rank or self.device != "cpu")

    def arena_max(self) -> int:
        if self.malloc_arena_max >= 0:
            return self.malloc_arena_max
        return 1 if self.device == "cpu" else 0

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (a Hugging Face checkpoint folder)")
        if self.transfer_protocol not in ("tcp", "rdma", "nvlink_intra", "inprocess", "skip"):
            raise ValueError(
                "transfer_protocol must be tcp, rdma, nvlink_intra, inprocess or skip, "
                f"got {self.transfer_protocol!r}"
            )
        if self.engine not in ("model", "sim"):
            raise ValueError(f"engine must be model or sim, got {self.engine!r}")
        if self.engine == "sim" and self.ep_size > 1:
            raise ValueError("engine=sim models one rank: ep_size must be 1")
        if self.dp_size not in (0, self.ep_size):
            raise ValueError(
                f"dp_size must equal ep_size ({self.ep_size}): every EP rank runs attention on its own requests"
            )
        if self.attention_backend not in ("auto", "torch", "triton", "flashinfer"):
            raise ValueError(
                f"attention_backend must be auto, torch, triton or flashinfer, got {self.attention_backend!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in ("auto", "fp8", "none"):
            raise ValueError(f"quantization must be auto, fp8 or none, got {self.quantization!r}")
        if self.ep_size > 1 and self.kv_per_rank and self.transfer_protocol == "inprocess":
            raise ValueError("per-rank KV pools live in the rank processes: use a Mooncake transfer_protocol")
        if self.two_batch_overlap and (self.engine == "sim" or self.mtp_k):
            raise ValueError("two_batch_overlap runs the model engine without MTP")
        host_tier = self.host_kv_pages > 0 or self.host_kv_cache_gb > 0
        if host_tier and (self.ep_size > 1 or self.mtp_k or not self.enable_prefix_cache):
            raise ValueError("the host KV tier needs the prefix cache, ep_size 1 and no MTP (mtp_k 0)")
        if self.kv_store_master and not host_tier:
            raise ValueError("kv_store_master: the shared KV store stages its pages in the host tier: set host_kv_pages")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup must be auto, on or off, got {self.warmup!r}")
        if self.ep_backend not in ("auto", "fixed", "torch", "deepep", "mooncake"):
            raise ValueError(
                f"ep_backend must be auto, fixed, torch, deepep or mooncake, got {self.ep_backend!r}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name

    @property
    def activation_dtype(self) -> str:
        """dtype with auto resolved: 16-bit activations on a GPU (as SGLang and vLLM serve DeepSeek-V3)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def engine_attention_backend(self) -> str:
        """The engine's attention_backend setting (the prefill worker resolves auto per device)."""
        return self.attention_backend
