"""bench/decode_rank's Engine at toy width on CPU under Triton's interpreter: the rank's model builds with
only its local experts, takes the fused path with emulated EP, joins requests as a decode worker does and
steps. Times nothing (the GPU's to measure); keeps the benchmark's path from rotting between device runs."""

from __future__ import annotations

import pytest
import torch

from tests.libs.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real benchmark")


def _toy_config():
    """DeepSeek-V3's shape at toy width: one dense layer, one MoE layer of 16 experts (top-4 of 4 groups)."""
    from libs.engine.presets import deepseek_v3_config

    return deepseek_v3_config(
        hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128,
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, vocab_size=600,
        max_position_embeddings=256,
    )  # fmt: skip


def test_rank_engine_builds_local_experts_and_steps_on_the_fused_path():
    import bench.decode_rank as R

    config = _toy_config()
    engine = R.build_engine(
        config, ep=8, physical=16, max_batch=4, max_ctx=64, device="cpu", dtype=torch.float16,
        attention="triton", page_size=16,
    )  # fmt: skip
    moe = engine.model.model.layers[1].mlp
    assert moe.experts.gate_up_proj.shape[0] == 2  # 16 physical / EP 8: two local experts
    assert moe.fast is not None and moe.fast.emulate_ep is not None and moe.fast.shared_id == 2
    rids = R.fill(engine, 3, ctx=20, gen=4)
    for _ in range(2):
        out = engine.step()
        assert sorted(o.rid for o in out) == sorted(rids)
        assert all(len(o.token_ids) == 1 and 0 <= o.token_ids[0] < 600 for o in out)


def test_rank_engine_with_an_fp8_kv_cache_steps_through_the_fp8_kernels(monkeypatch: pytest.MonkeyPatch):
    """--kv-cache-dtype fp8_e4m3 with 16 heads (the FP8 decode kernel's head tile): the fused write fills FP8
    rows, every layer's decode runs the FP8 MLA kernel, and the rows it reads carry the written scales."""
    import bench.decode_rank as R
    from libs.engine.layers.attention_backend import TritonAttention
    from libs.kernels import mla_decode_fp8

    calls = []
    kernel = mla_decode_fp8.mla_decode_fp8
    monkeypatch.setattr(mla_decode_fp8, "mla_decode_fp8", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    config = {**_toy_config(), "num_attention_heads": 16, "num_key_value_heads": 16}
    engine = R.build_engine(
        config, ep=8, physical=16, max_batch=4, max_ctx=64, device="cpu", dtype=torch.float16,
        attention="triton", page_size=16, kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    pool, cfg = engine.kv_pool, engine.model.config
    assert pool.buffer.dtype == torch.uint8 and pool.bytes_per_page == 16 * 656
    # the kernels on CPU tensors (Triton's interpreter), as on a GPU without being asked
    engine.runner.backend = TritonAttention(cfg, pool.buffer.device, torch.float16, True, "fp8_e4m3")
    # FP8 bytes, bf16 attention dots (the Engine's DECODE_DOTS): the roofline takes the bf16 peak for them
    assert R.kv_roofline(engine) == {"kv_bytes": 656 / 576, "mla_fp8": False}
    rids = R.fill(engine, 3, ctx=20, gen=4)
    seq = engine.requests[rids[0]]
    pos = seq.num_computed  # the newest token, fed next: its row is written this step
    slot = seq.pages[pos // 16] * 16 + pos % 16
    pool.buffer[:, slot] = 0
    out = engine.step()
    assert sorted(o.rid for o in out) == sorted(rids) and len(calls) == 2  # both layers, one step
    scale = pool.buffer[:, slot, 640:644].contiguous().view(torch.float32)
    assert (scale > 0).all() and pool.buffer[:, slot, :512].any()


@pytest.mark.parametrize("tbo", [False, True])
def test_rank_engine_with_the_real_dispatcher_at_world_1_steps(tbo: bool):
    """--dispatch real: the MoE layers take the stepped EP hook (fixed dispatcher over a one-rank gloo group,
    FP8 experts through the grouped GEMMs) and the engine steps as with the emulated mapping; with --tbo the
    dispatcher's rounds hold one micro-batch (half the batch)."""
    import torch.distributed as dist

    import bench.decode_rank as R
    from libs.ep.stepped import SteppedEPHook

    config = _toy_config()
    try:
        engine = R.build_engine(
            config, ep=8, physical=16, max_batch=4, max_ctx=64, device="cpu", dtype=torch.float16,
            attention="triton", page_size=16, dispatch="real", two_batch_overlap=tbo,
        )  # fmt: skip
        moe = engine.model.model.layers[1].mlp
        assert isinstance(moe.ep, SteppedEPHook) and moe.fast is None and moe.graph_safe
        assert moe.experts.gate_up_proj.shape[0] == 2 and moe.ep.dispatcher.capacity == (2 if tbo else 4)
        rids = R.fill(engine, 3, ctx=20, gen=4)
        for _ in range(2):
            out = engine.step()
            assert sorted(o.rid for o in out) == sorted(rids)
            assert all(len(o.token_ids) == 1 and 0 <= o.token_ids[0] < 600 for o in out)
        assert int(moe.ep.load.sum()) > 0  # the hook counted the routed picks
        assert not tbo or engine.model.tbo.split_forwards > 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_process_group_gets_a_cuda_device_with_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's init_process_group refuses device_id=torch.device("cuda") ("Please use a device_id with
    index"): a bare "cuda" becomes the current device."""
    import bench.decode_rank as R

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert R.indexed_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert R.indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert R.indexed_device(torch.device("cpu")) is None
