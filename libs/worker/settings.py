"""Settings every worker service has (env prefix MOEMESH_PREFILL_WORKER_ / MOEMESH_DECODE_WORKER_)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from libs.bus.settings import ServiceSettings


class WorkerSettings(ServiceSettings, frozen=True, kw_only=True):
    model_dir: str = ""  # a Hugging Face checkpoint folder (required)
    served_model_name: str = ""  # empty: the folder's name
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU | float32 | bfloat16 | float16
    quantization: str = "auto"  # FP8 checkpoints: auto (FP8 on CUDA) | fp8 | none (dequantize to dtype)
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    num_pages: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: the engine's default
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_prefill_tokens: Annotated[int, msgspec.Meta(ge=1)] = 2048
    enable_prefix_cache: bool = True
    # attention backend of a single-rank engine (libs/engine/layers/attention_backend.py): auto | torch |
    # triton | flashinfer; EP ranks keep "auto"
    attention_backend: str = "auto"
    transfer_protocol: str = "tcp"  # tcp | rdma | nvlink_intra | inprocess (tests) | skip (engine=sim)
    transfer_hostname: str = "127.0.0.1"
    transfer_device: str = ""  # RDMA device names, e.g. "mlx5_0"
    # torch intra-op threads on CPU; several worker processes share a host's cores (0: torch's default)
    torch_threads: Annotated[int, msgspec.Meta(ge=0)] = 1
    heartbeat_interval_ms: Annotated[int, msgspec.Meta(ge=10)] = 250
    # no heartbeat out for this long: every thread's Python stack to the log, from a C thread that needs
    # neither the loop nor the GIL (libs/worker/heartbeat.py); the mesh has called the worker dead by then.
    # 0: off
    stall_dump_s: Annotated[float, msgspec.Meta(ge=0)] = 3.0
    # Python's GIL switch interval in this process (sys.setswitchinterval): the engine thread's host work
    # holds the GIL while the event loop waits to answer the bus, up to this long per hand-back (Python's
    # default is 5 ms; bench/gil_switch.py measures what it costs an event loop beside a busy thread)
    gil_switch_interval_ms: Annotated[float, msgspec.Meta(gt=0, le=100)] = 0.5
    broker_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # expert parallelism (libs/ep): ep_size rank processes, each with its own requests and KV (DP attention)
    # and 1/ep_size of the routed experts; 1 runs the engine in this process, as before
    ep_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    dp_size: Annotated[int, msgspec.Meta(ge=0)] = 0  # attention DP ranks: 0 or ep_size (every EP rank)
    # dispatch/combine: auto (fixed on CUDA, torch on CPU) | fixed (fixed-capacity buffers, no host sync) |
    # torch (all_to_all over gloo/NCCL) | deepep | mooncake
    ep_backend: str = "auto"
    ep_redundant_experts: Annotated[int, msgspec.Meta(ge=0)] = 0  # extra physical expert slots for EPLB
    ep_fp8_dispatch: bool = False
    # each EP rank registers its own KV pool on its own transport and handles name the rank (what device
    # cuda always does: the pools live on the ranks' GPUs); off on CPU: one shared pool, one region
    ep_kv_per_rank: bool = False
    eplb_interval_steps: Annotated[int, msgspec.Meta(ge=0)] = 0  # rebalance experts every N steps (0: never)
    # two-batch overlap (libs/engine/two_batch_overlap.py): every forward as two micro-batches, one's EP
    # dispatch/combine in flight while the other computes (any attention backend; FlashInfer plans one
    # wrapper per micro-batch); an EP rank's fixed dispatcher then holds a micro-batch, half max_num_seqs
    two_batch_overlap: bool = False
    # engine: "model" runs the checkpoint; "sim" the timing-model engine (libs/sim: config and tokenizer
    # only, forward passes replaced by waits fitted to the H200 decode records, deterministic tokens)
    engine: str = "model"
    sim_speed: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # > 1: the modeled GPU runs that much faster
    sim_prefill_ms_per_token: Annotated[float, msgspec.Meta(ge=0)] = 0.04
    sim_prefill_fixed_ms: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    # MTP speculative decoding (libs/engine/speculative.py): draft tokens per step from the checkpoint's
    # MTP module, verified by the target in one forward; 0: off. Needs num_nextn_predict_layers >= 1.
    mtp_k: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0
    # warm-up before the first heartbeat (libs/worker/warmup.py): prefills of lengths up to max_prefill_tokens
    # and (decode worker) each decode-graph batch size, so kernels compile and tune before requests come;
    # auto: on for a model on CUDA, off on the CPU and for engine=sim | on | off
    warmup: str = "auto"

    @property
    def kv_per_rank(self) -> bool:
        """EP ranks keep their own KV pools (rank_kv.py): asked for, or forced by pools on GPUs."""
        return self.ep_size > 1 and (self.ep_kv_per_rank or self.device != "cpu")

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
        if self.quantization not in ("auto", "fp8", "none"):
            raise ValueError(f"quantization must be auto, fp8 or none, got {self.quantization!r}")
        if self.ep_size > 1 and self.kv_per_rank and self.transfer_protocol == "inprocess":
            raise ValueError("per-rank KV pools live in the rank processes: use a Mooncake transfer_protocol")
        if self.two_batch_overlap and (self.engine == "sim" or self.mtp_k):
            raise ValueError("two_batch_overlap runs the model engine without MTP")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup must be auto, on or off, got {self.warmup!r}")
        if self.ep_backend not in ("auto", "fixed", "torch", "deepep", "mooncake"):
            raise ValueError(f"ep_backend must be auto, fixed, torch, deepep or mooncake, got {self.ep_backend!r}")

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
