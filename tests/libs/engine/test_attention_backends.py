"""The kernel-path attention (paged metadata on the device) against the plain-torch reference.

Function level: ragged batches with cached prefixes and chunked prefill through `mla_extend_sdpa`,
decode through the torch paged decode and through the Triton kernel (CPU: Triton's interpreter, see
conftest.py), each equal to `mla_expanded` / `mla_absorbed` on the same pool. Engine level: greedy
generation with the "triton" backend equals the "torch" one, with prefix-cache hits and chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.engine import Engine
from libs.engine.forward_batch import ForwardBatch
from libs.engine.layers.attention_backend import (
    MLAWeights,
    TorchAttention,
    TritonAttention,
    make_attention_backend,
    pack_batch,
    resolve_backend,
)
from libs.engine.loader import load_model
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import write_tiny_model

HAS_CUDA = torch.cuda.is_available()
PAGE = 4
# (prefix, new tokens) per sequence: a fresh prompt, a chunk after a cached prefix, a one-token chunk
# (decode-shaped) inside an extend batch, and a chunk that ends mid-page
RAGGED = [(0, 7), (5, 3), (13, 1), (8, 6)]


def _cfg(**kw):
    from libs.engine.config import ModelConfig
    from libs.engine.tiny import tiny_config

    return ModelConfig.from_dict(tiny_config(**kw))


def _batch(spans, page_size=PAGE, num_pages=64, seed=0) -> ForwardBatch:
    """Scattered pages per sequence; out_slots at each new token's position."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_pages, generator=g).tolist()
    ids, pos, slots, tables = [], [], [], []
    for prefix, new in spans:
        end = prefix + new
        table = torch.tensor([free.pop() for _ in range(-(-end // page_size) + 1)])  # one spare page
        p = torch.arange(prefix, end)
        ids.append(torch.randint(0, 100, (new,), generator=g))
        pos.append(p)
        slots.append(table[p // page_size] * page_size + p % page_size)
        tables.append(table)
    return ForwardBatch(
        torch.cat(ids),
        torch.cat(pos),
        torch.cat(slots),
        [n for _, n in spans],
        [p + n for p, n in spans],
        tables,
    )


def _inputs(cfg, batch, num_pages=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    t, h = batch.input_ids.shape[0], cfg.num_attention_heads
    rows = torch.randn(num_pages * PAGE, cfg.kv_row_dim, generator=g)
    w = torch.randn(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, generator=g) / 8
    q_nope = torch.randn(t, h, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(t, h, cfg.qk_rope_head_dim, generator=g)
    return q_nope, q_pe, rows, MLAWeights.from_dense(w, h, cfg.qk_nope_head_dim)


def _attend(backend, batch, inputs, absorbed):
    q_nope, q_pe, rows, weights = inputs
    step = backend.prepare(batch, PAGE, absorbed)
    return backend.attend(q_nope, q_pe, rows, weights, step)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_extend_with_prefixes_matches_expanded_reference():
    cfg, batch = _cfg(), _batch(RAGGED)
    inputs = _inputs(cfg, batch)
    cpu = torch.device("cpu")
    ref = _attend(TorchAttention(cfg, cpu), batch, inputs, absorbed=False)
    got = _attend(TritonAttention(cfg, cpu, torch.float32), batch, inputs, absorbed=False)
    assert got.shape == ref.shape == (batch.input_ids.shape[0], cfg.num_attention_heads, cfg.v_head_dim)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_paged_torch_decode_matches_absorbed_reference():
    cfg, batch = _cfg(), _batch([(0, 1), (6, 1), (16, 1), (30, 1)])
    inputs = _inputs(cfg, batch)
    cpu = torch.device("cpu")
    backend = TritonAttention(cfg, cpu, torch.float32)
    assert backend.kernel_cfg is None  # tiny dims: the plain-torch paged decode
    ref = _attend(TorchAttention(cfg, cpu), batch, inputs, absorbed=True)
    torch.testing.assert_close(_attend(backend, batch, inputs, absorbed=True), ref, atol=1e-5, rtol=1e-5)


def test_triton_decode_kernel_matches_absorbed_reference():
    # DeepSeek's latent row (512 + 64) so the kernel applies; without a GPU the interpreter runs it on CPU
    # tensors (float32), with one it runs compiled on bf16 copies
    cfg = _cfg(
        kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16, qk_nope_head_dim=16, v_head_dim=16
    )
    batch = _batch([(0, 1), (19, 1), (44, 1)], num_pages=40)
    inputs = _inputs(cfg, batch, num_pages=40)
    ref = _attend(TorchAttention(cfg, torch.device("cpu")), batch, inputs, absorbed=True)
    device, dtype, tol = ("cuda", torch.bfloat16, 2e-2) if HAS_CUDA else ("cpu", torch.float32, 1e-4)
    q_nope, q_pe, rows, w = inputs
    weights = MLAWeights.from_dense(w.dense.to(device, dtype), cfg.num_attention_heads, cfg.qk_nope_head_dim)
    on_device = tuple(x.to(device, dtype) for x in (q_nope, q_pe, rows))
    backend = TritonAttention(cfg, torch.device(device), dtype, use_kernel=True)
    assert backend.kernel_cfg is not None
    got = _attend(backend, batch, (*on_device, weights), absorbed=True)
    assert _rel(got.cpu(), ref) < tol


def test_pack_batch_is_real_pages_and_rejects_short_tables():
    batch = _batch([(0, 3), (5, 1)])
    packed, width = pack_batch(batch, PAGE)
    t, s = 4, 2
    assert width == 2  # ceil(6 / 4): the longest sequence's pages, not one entry per key
    assert packed[:t].tolist() == batch.input_ids.tolist()
    assert packed[2 * t : 3 * t].tolist() == batch.out_slots.tolist()
    assert packed[3 * t : 3 * t + s].tolist() == [3, 6]
    table = packed[3 * t + s :].view(s, width)
    assert table[0].tolist() == [batch.page_tables[0][0].item(), 0]  # 3 tokens: one page, then padding
    assert table[1].tolist() == batch.page_tables[1][:2].tolist()
    batch.page_tables[1] = batch.page_tables[1][:1]
    with pytest.raises(ValueError, match="sequence 1: page table has 1 pages"):
        pack_batch(batch, PAGE)


def test_flashinfer_ragged_prefill_takes_only_the_head_dims_it_compiles():
    from libs.kernels.flashinfer_mla import ragged_prefill_fits

    assert ragged_prefill_fits(192, 128)  # DeepSeek-V3's expanded heads
    assert not ragged_prefill_fits(96, 32)  # the tiny test dims: "Invalid configuration" on the H200


def test_backend_names():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    from libs.kernels import flashinfer_mla

    on_cuda = "flashinfer" if flashinfer_mla.available() else "triton"  # FlashInfer where it imports
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("auto", cuda) == on_cuda
    assert resolve_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("flash", cpu)
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("flashinfer", _cfg(), cpu, torch.float32)


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    path = write_tiny_model(
        tmp_path_factory.mktemp("mla512"), seed=3, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16,
        qk_nope_head_dim=16, v_head_dim=16, num_hidden_layers=2, hidden_size=64, intermediate_size=64,
        q_lora_rank=32,
    )  # fmt: skip
    return load_model(path, progress=False)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 20], [30, 31]]


def _generate(model, backend: TritonAttention | None = None, **kw):
    engine = Engine(model, page_size=PAGE, num_pages=64, max_prefill_tokens=kw.pop("max_prefill_tokens", 64))
    if backend is not None:
        engine.runner.backend = backend
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    first = [o.token_ids for o in engine.generate(PROMPTS, greedy)]
    again = [o.token_ids for o in engine.generate(PROMPTS[:2], greedy)]  # prefix-cache hits
    assert engine.stats()["cached_pages"] > 0
    return first, again


@pytest.mark.parametrize(
    "use_kernel",
    [
        False,
        pytest.param(
            True, marks=pytest.mark.skipif(HAS_CUDA, reason="CPU interpreter; GPU: test_cuda_graph")
        ),
    ],
)
def test_engine_triton_backend_generates_the_reference_tokens(kernel_model, use_kernel):
    ref = _generate(kernel_model)
    backend = TritonAttention(
        kernel_model.config, kernel_model.device, kernel_model.dtype, use_kernel=use_kernel
    )
    assert (backend.kernel_cfg is not None) == use_kernel
    assert _generate(kernel_model, backend, max_prefill_tokens=4) == ref  # chunked prefill too


def test_fp8_row_layout_follows_the_named_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """"tensor" FP8 rows only where FlashInfer's FP8 decode will read them: backend "flashinfer" named, a
    16-bit model, DeepSeek's 512 + 64 row; "auto" (even where it resolves to FlashInfer), triton and torch,
    float32 models and other dims keep "token" rows."""
    from libs.engine.layers import attention_backend as ab

    v3 = _cfg(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16)
    assert {ab.fp8_scales(n, v3, "cpu", torch.bfloat16) for n in ("auto", "torch", "triton")} == {"token"}
    monkeypatch.setattr(ab, "resolve_backend", lambda name, device: "flashinfer" if name == "auto" else name)
    assert ab.fp8_scales("flashinfer", v3, "cuda", torch.bfloat16) == "tensor"
    assert ab.fp8_scales("auto", v3, "cuda", torch.bfloat16) == "token"
    assert ab.fp8_scales("flashinfer", v3, "cuda", torch.float32) == "token"
    assert ab.fp8_scales("flashinfer", _cfg(), "cuda", torch.bfloat16) == "token"  # the tiny 32 + 8 row


def test_joined_query_is_a_view_where_the_rope_part_continues_the_query_else_a_copy():
    """The fused path's prefill query [T, H, N + r] reaches the expanded attention whole (no copy) when its
    rope part was rotated in place; separate tensors, or slices that do not meet, are concatenated."""
    from libs.engine.layers.mla import joined_query

    q = torch.randn(5, 4, 24)
    whole = joined_query(q[..., :16], q[..., 16:])
    assert whole.data_ptr() == q.data_ptr() and torch.equal(whole, q)
    q_pe = torch.randn(5, 4, 8)
    assert torch.equal(joined_query(q[..., :16], q_pe), torch.cat([q[..., :16], q_pe], -1))
    apart = joined_query(q[..., :12], q[..., 16:])  # a gap between them: copied, the gap left out
    assert apart.shape == (5, 4, 20) and apart.data_ptr() != q.data_ptr()
    assert torch.equal(apart, torch.cat([q[..., :12], q[..., 16:]], -1))
