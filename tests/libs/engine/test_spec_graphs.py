"""MTP verify and draft as decode rows (libs/engine/spec_graphs.py): on CPU, the row expansion, the rows'
forward == the reference's absorbed multi-token chunks, MTPEngine on the paged backend greedy-identical
to the plain engine, and the captured bodies on padded packed inputs == the eager rows; on a GPU, verify
and draft replayed from CUDA graphs give the eager rows' logits and the plain engine's greedy tokens.

GPU run (the lead batches device runs): `pytest -q -m gpu tests/libs/engine/test_spec_graphs.py`. The GPU
tests keep the FP8 GEMMs' first-use tuning out (`untimed_gemms`): on the H200 it compiled and graph-timed
every Triton and Gluon candidate for every GEMM shape and bucket of rows of three tiny models, and the file
ran past 100 s; the kernels' choice and its timing are test_gemm_tuning's and test_fp8_engine_gpu's subject,
this file's are the verify/draft graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.cuda_graph import DecodeLayout, fill_decode_inputs, static_step
from libs.engine.kv_pool import KVPool
from libs.engine.layers.attention_backend import TorchAttention, TritonAttention
from libs.engine.loader import load_model
from libs.engine.runner import Chunk, build_batch
from libs.engine.spec_graphs import RowGraphRunner, chunk_rows, row_chunks
from libs.engine.speculative import MTPEngine
from libs.engine.tiny import write_tiny_model

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 40, 41], list(range(100, 137)), [300]]


def test_chunks_become_one_row_per_token():
    chunks = [Chunk([7, 8, 9], 5, [3, 4]), Chunk([1], 0, [6]), Chunk([2, 3], 14, [0, 1, 2, 9])]
    tokens, positions, tables = chunk_rows(chunks)
    assert tokens == [7, 8, 9, 1, 2, 3]
    assert positions == [5, 6, 7, 0, 14, 15]
    assert tables == [[3, 4]] * 3 + [[6]] + [[0, 1, 2, 9]] * 2
    rows = row_chunks(chunks)
    assert [(r.tokens, r.start, r.pages) for r in rows[:2]] == [([7], 5, [3, 4]), ([8], 6, [3, 4])]
    assert build_batch(rows, 4).is_decode  # the decode form: one token per "sequence"
    assert chunk_rows([]) == ([], [], [])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("rows"), seed=5), progress=False)


def test_rows_forward_equals_the_chunks_absorbed_reference(model):
    """A verify chunk of 3 tokens as 3 decode rows on the paged backend: the same hidden states and the same
    KV rows as the torch reference's absorbed multi-token chunk (each row sees its causal prefix)."""
    cfg = model.config
    pools = [
        KVPool(cfg.num_hidden_layers, 16, 4, cfg.kv_row_dim, model.dtype, model.device) for _ in range(2)
    ]
    prompts = [Chunk([5, 6, 7, 8, 9], 0, [1, 2, 3]), Chunk([20, 21], 0, [4, 5])]
    for pool in pools:
        model(build_batch(prompts, 4), pool)
    verify = [Chunk([10, 11, 12], 5, [1, 2, 3]), Chunk([22, 23, 24], 2, [4, 5])]  # crosses a page boundary
    ref = model(
        build_batch(verify, 4), pools[0], attn_mode="absorbed", backend=TorchAttention(cfg, model.device)
    )
    paged = TritonAttention(cfg, model.device, model.dtype)
    got = model(build_batch(row_chunks(verify), 4), pools[1], backend=paged)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1].buffer, pools[0].buffer, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_engine_on_the_paged_backend_is_greedy_identical(tmp_path, k):
    path = write_tiny_model(tmp_path, seed=3, num_nextn_predict_layers=1)
    kw = dict(page_size=4, max_prefill_tokens=16, attention_backend="triton")
    ref = [o.token_ids for o in Engine.from_pretrained(path, **kw).generate(PROMPTS, GREEDY)]
    spec = MTPEngine.load(path, mtp_k=k, **kw)
    assert spec._rows and spec.verify_graphs is None and spec.draft_graphs is None  # CPU: eager rows
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == ref
    assert spec.num_drafted > 0
    spec.flush_prefix_cache()
    assert spec.stats()["free_pages"] == spec.stats()["total_pages"]


def test_mtp_engine_rows_agree_with_the_reference_path_on_a_trained_model(tmp_path):
    """On the demo recipe (drafts often accepted) the paged rows accept what the reference accepts."""
    from libs.demo.train import build_demo_model, quick_settings

    path = build_demo_model(
        tmp_path / "demo", quick_settings(steps=60, batch_size=4, seq_len=64), log=lambda _: None
    )
    engines = [MTPEngine.load(path, mtp_k=2, attention_backend=b) for b in ("torch", "triton")]
    tok = engines[0].tokenizer
    assert tok is not None
    prompts = [tok.encode(t) for t in ("A list is", "The import statement", "class")]
    outs = [[o.token_ids for o in e.generate(prompts, GREEDY)] for e in engines]
    assert outs[0] == outs[1]
    assert engines[1].num_accepted == engines[0].num_accepted > 0


def _padded_inputs(tokens, positions, tables, batch, max_pages, scratch):
    layout = DecodeLayout(batch, max_pages)
    buf = np.zeros(layout.size, dtype=np.int32)
    fill_decode_inputs(buf, layout, tokens, positions, tables, 4, scratch)
    return torch.from_numpy(buf), layout


def test_captured_bodies_on_padded_inputs_equal_the_eager_rows(tmp_path):
    """What the verify and draft graphs replay, run eagerly on CPU: packed int32 rows padded with scratch
    rows. Real rows give the eager rows' hidden states, logits and MTP states; padding writes only the
    scratch page."""
    path = write_tiny_model(tmp_path, seed=3, num_nextn_predict_layers=1)
    engine = MTPEngine.load(path, mtp_k=2, page_size=4, num_pages=32, attention_backend="triton")
    pages = engine.allocator.alloc(3)
    prompt = Chunk([5, 6, 7, 8, 9, 10], 0, pages)
    engine._target([prompt])
    chunks = [Chunk([11, 12, 13], 6, pages)]
    kv_before, mtp_before = engine.kv_pool.buffer.clone(), engine.mtp_pool.buffer.clone()
    hidden, logits = engine._verify_forward(chunks)  # eager rows (no graphs on CPU)
    mtp_hidden = torch.randn(3, engine.config.hidden_size)
    draft = engine._mtp_forward(chunks, mtp_hidden)
    engine.kv_pool.buffer.copy_(kv_before)
    engine.mtp_pool.buffer.copy_(mtp_before)
    scratch = 31  # never allocated here
    packed, layout = _padded_inputs(*chunk_rows(chunks), batch=4, max_pages=3, scratch=scratch)
    step = static_step(packed, layout, 4, engine.runner.backend)
    got_hidden, got_logits = engine._verify_body(step, None)
    pad = torch.cat([mtp_hidden, torch.zeros(1, mtp_hidden.shape[1])])
    (got_draft,) = engine._draft_body(static_step(packed, layout, 4, engine.runner.backend), pad)
    torch.testing.assert_close(got_hidden[:3], hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits[:3], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_draft[:3], draft, atol=1e-5, rtol=1e-5)
    diff = (engine.kv_pool.buffer - kv_before).abs().amax(dim=(0, 2))  # per slot
    written = {pages[p // 4] * 4 + p % 4 for p in (6, 7, 8)}
    assert set(diff.nonzero().flatten().tolist()) <= written | {scratch * 4}


def test_row_graph_runner_checks_its_inputs(model):
    cfg = model.config
    kw = dict(page_size=4, scratch_page=9, max_pages=3, device=model.device)
    with pytest.raises(ValueError, match="cannot be captured"):
        RowGraphRunner(lambda s, h: (), TorchAttention(cfg, model.device), [1, 2], **kw)
    paged = TritonAttention(cfg, model.device, model.dtype)
    with pytest.raises(ValueError, match="bad row graph setup"):
        RowGraphRunner(lambda s, h: (), paged, [1, 2], hidden_dim=8, **kw)  # no dtype for the hidden input
    runner = RowGraphRunner(lambda s, h: (), paged, [1, 2, 4], hidden_dim=8, hidden_dtype=torch.float32, **kw)
    assert runner.can_run(3, [0, 5, 11]) and not runner.can_run(5, [0] * 5) and not runner.can_run(1, [12])
    with pytest.raises(ValueError, match="exceed the largest"):
        runner.run([1] * 5, [0] * 5, [[0]] * 5, torch.zeros(5, 8))
    with pytest.raises(ValueError, match="hidden input"):
        runner.run([1, 2], [0, 1], [[0], [0]], None)
    with pytest.raises(ValueError, match="hidden input"):
        runner.run([1, 2], [0, 1], [[0], [0]], torch.zeros(3, 8))


# --- GPU ---

# FP8 experts (graph-safe masked layout) and attention projections (the fused decoder path) on a tiny model
TINY_FP8 = dict(
    hidden_size=256, intermediate_size=192, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    num_nextn_predict_layers=1,
)  # fmt: skip
KERNEL_DIMS = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16, qk_nope_head_dim=32, v_head_dim=32
)
# the fused decoder path's MLA dims (R 512, r 64, V 128): the target and the MTP block run fused
FUSED_DIMS = KERNEL_DIMS | dict(v_head_dim=128)


@pytest.fixture
def untimed_gemms(monkeypatch):
    """The FP8 GEMMs take their first candidate (the Triton kernel, its first tile config, no split-K) without
    compiling and timing the others; fresh choice caches, so no other test sees these choices."""
    from libs.kernels import fp8_gemm, gemm_tuning

    for name in ("_TRITON_CONFIG", "_KERNEL_CHOICE", "_SPLIT_CHOICE"):
        monkeypatch.setattr(fp8_gemm, name, {})
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: 0.0)


def _fp8_path(tmp_path, dims):
    return write_tiny_model(tmp_path, seed=7, fp8=True, **(TINY_FP8 | dims))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("dims", "dtype"),
    [({}, "float32"), (KERNEL_DIMS, "bfloat16"), (FUSED_DIMS, "bfloat16")],
    ids=["tiny-f32", "kernel-bf16", "fused-bf16"],
)
def test_verify_and_draft_graphs_equal_the_eager_rows(tmp_path, dims, dtype, untimed_gemms):
    path = _fp8_path(tmp_path, dims)
    kw = dict(
        device="cuda", dtype=dtype, page_size=16, num_pages=64, max_num_seqs=4, num_speculative_tokens=2
    )
    graphed = MTPEngine.load(path, **kw)
    assert graphed.verify_graphs is not None and graphed.draft_graphs is not None
    assert (graphed.mtp.fast is not None) == (dims is FUSED_DIMS)
    pages = graphed.allocator.alloc(2)
    graphed._target([Chunk(list(range(5, 22)), 0, pages)])
    chunks = [Chunk([30, 31, 32], 17, pages)]
    hidden = torch.randn(3, graphed.config.hidden_size, device="cuda", dtype=graphed.model.dtype)
    got = [t.clone() for t in graphed._replay("verify_graphs", chunks) or ()]
    (got_draft,) = [t.clone() for t in graphed._replay("draft_graphs", chunks, hidden) or ()]
    assert graphed.verify_graphs.captured == [4] and graphed.draft_graphs.captured == [4]  # 3 rows pad to 4
    eager_hidden = graphed._target(row_chunks(chunks))  # the same rows (and KV writes), eagerly
    eager_logits = graphed.model.compute_logits(eager_hidden)
    runner, graphed.draft_graphs = graphed.draft_graphs, None
    eager_draft = graphed._mtp_forward(chunks, hidden)
    graphed.draft_graphs = runner
    tol = 2e-2 if dtype == "bfloat16" else 1e-3
    for a, b in ((got[0], eager_hidden), (got[1], eager_logits), (got_draft, eager_draft)):
        err = ((a.float() - b.float()).abs() / (1 + b.float().abs().amax(-1, keepdim=True))).max().item()
        assert err < tol, err


@pytest.mark.gpu
@gpu
def test_mtp_engine_with_graphs_gives_the_plain_greedy_tokens(tmp_path, untimed_gemms):
    path = _fp8_path(tmp_path, {})
    kw = dict(device="cuda", page_size=16, num_pages=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [
        o.token_ids for o in Engine.from_pretrained(path, cuda_graphs=False, **kw).generate(PROMPTS, params)
    ]
    eager = MTPEngine.load(path, mtp_k=2, cuda_graphs=False, **kw)
    graphed = MTPEngine.load(path, mtp_k=2, **kw)
    assert eager.verify_graphs is None and graphed.verify_graphs is not None
    assert [o.token_ids for o in eager.generate(PROMPTS, params)] == ref
    assert [o.token_ids for o in graphed.generate(PROMPTS, params)] == ref
    assert (
        graphed.verify_graphs.captured and graphed.draft_graphs is not None and graphed.draft_graphs.captured
    )
    graphed.flush_prefix_cache()
    assert graphed.stats()["free_pages"] == graphed.stats()["total_pages"]
