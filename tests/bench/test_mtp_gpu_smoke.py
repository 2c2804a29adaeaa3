"""bench/mtp_gpu's path at toy width on CPU: the target and MTP module build with random FP8 weights from a
DeepSeek-V3 config, requests join as a decode worker's do, and MTPEngine and the plain Engine step with
the records filled. Times nothing (the GPU's to measure); keeps the benchmark's path from rotting between
device runs."""

from __future__ import annotations

import pytest
import torch

from tests.libs.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real benchmark")


def test_mtp_gpu_bench_builds_and_steps_at_toy_width():
    from bench import mtp_gpu
    from libs.engine.presets import deepseek_v3_config
    from libs.quant.fp8 import FP8_DTYPE

    config = deepseek_v3_config(
        hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128,
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, vocab_size=600,
        max_position_embeddings=512,
    )  # fmt: skip
    model, mtp = mtp_gpu.build_models(config, device="cpu", dtype=torch.float32)
    assert mtp.mlp.experts.gate_up_proj.dtype == FP8_DTYPE and mtp.eh_proj.is_fp8
    assert mtp.embed_tokens is model.model.embed_tokens  # shared, as DeepSeek's checkpoints do
    kw = dict(ctx=40, attn="triton", warmup=1, iters=1, page_size=16)  # slow: FP8 references on CPU
    plain = mtp_gpu.measure(model, mtp, 2, 0, **kw)
    spec = mtp_gpu.measure(model, mtp, 2, 2, **kw)
    assert plain["step_ms"] > 0 and not plain["cuda_graphs"]
    assert spec["step_ms"] > 0 and spec["verify_graph_ms"] is None and 0 <= spec["acceptance_rate"] <= 1
