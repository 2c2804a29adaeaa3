"""Decode CUDA graphs: the pure bucket/padding logic on CPU; on a GPU, graph replay == eager == the CPU
float32 engine, and the prefill/decode attention backends == the torch reference.

GPU run (the lead batches device runs): `pytest -q -m gpu tests/libs/engine/test_cuda_graph.py`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from libs.engine.cuda_graph import (
    DecodeGraphRunner,
    DecodeLayout,
    GraphCaptureError,
    bucket_for,
    capture_sizes,
    decode_graphs_supported,
    fill_decode_inputs,
    static_step,
)
from libs.engine.engine import Engine
from libs.engine.layers.attention_backend import MLAWeights, TorchAttention, TritonAttention
from libs.engine.loader import load_model
from libs.engine.models.deepseek_v3 import MoE
from libs.engine.runner import Chunk
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import write_tiny_model
from tests.libs.engine.test_attention_backends import _rel

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def test_capture_sizes_are_powers_of_two_up_to_max():
    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_bucket_is_the_smallest_size_that_fits():
    sizes = [1, 2, 4, 8, 12]
    assert [bucket_for(n, sizes) for n in (1, 3, 4, 5, 9, 12)] == [1, 4, 4, 8, 12, 12]
    assert bucket_for(13, sizes) is None
    with pytest.raises(ValueError, match="at least one"):
        bucket_for(0, sizes)


def test_fill_decode_inputs_pads_into_the_scratch_page():
    layout, page, scratch = DecodeLayout(batch=4, max_pages=3), 4, 9
    buf = np.full(layout.size, -1, dtype=np.int32)
    fill_decode_inputs(buf, layout, [11, 12, 13], [0, 5, 9], [[2], [3, 7], [1, 4, 6, 8]], page, scratch)
    ids, pos, slots, lens, table = layout.views(buf)
    assert ids.tolist() == [11, 12, 13, 0] and pos.tolist() == [0, 5, 9, 0]
    assert slots.tolist() == [2 * 4, 7 * 4 + 1, 6 * 4 + 1, scratch * 4]  # padding writes the scratch page
    assert lens.tolist() == [1, 6, 10, 1]  # padding attends over its own single row
    assert table[0, 0] == 2 and table[1, :2].tolist() == [3, 7] and table[2].tolist() == [1, 4, 6]
    assert table[3, 0] == scratch
    assert buf[16:20].tolist() == [2, 3, 1, scratch]  # column-major: every row's first page, then the second
    # the buffer is reused: rows a smaller batch leaves become padding again
    fill_decode_inputs(buf, layout, [5], [2], [[6]], page, scratch)
    assert ids.tolist() == [5, 0, 0, 0] and lens.tolist() == [3, 1, 1, 1]
    assert slots[1:].tolist() == [scratch * 4] * 3 and table[1:, 0].tolist() == [scratch] * 3


def test_fill_decode_inputs_with_its_memo_writes_what_a_full_write_does():
    """Steps of a changing batch (rows grow a page, finish, join, move, one list regrown in place against
    the contract): with the memo every row's live table entries, slots and lengths equal a full write's,
    and so do those of a device buffer that receives only the prefix each step says it reads."""
    rng = random.Random(3)
    layout, page, scratch = DecodeLayout(batch=8, max_pages=12), 4, 99
    memo_buf, memo = np.zeros(layout.size, dtype=np.int32), [(None, 0)] * layout.batch
    device = np.zeros(layout.size, dtype=np.int32)
    fresh = iter(range(10**6))
    rows = [
        ([next(fresh) for _ in range(3)], rng.randrange(1, 12)) for _ in range(5)
    ]  # (page list, position)
    limit = page * layout.max_pages - 1
    for step in range(300):
        rows = [(pages, p + 1) for pages, p in rows]
        for pages, p in rows:
            if p // page + 1 > len(pages):
                pages += [next(fresh)]  # in place, as the engine's `r.pages += ...`
        event = rng.random()
        done = [k for k, (_, p) in enumerate(rows) if p >= limit]
        if done or event < 0.1 and len(rows) > 1:  # a finish
            del rows[done[0] if done else rng.randrange(len(rows))]
        elif event < 0.2 and len(rows) < layout.batch:  # a join, with a list of its own
            rows.insert(rng.randrange(len(rows) + 1), ([next(fresh) for _ in range(2)], 5))
        elif event < 0.25:  # a list cut and regrown in place (the check catches its last entry)
            pages, p = rows[rng.randrange(len(rows))]
            need = p // page + 1
            del pages[need - 1 :]
            pages += [next(fresh) for _ in range(need - len(pages))]
        if not rows:
            rows = [([next(fresh)], 0)]
        tables, pos = [pages for pages, _ in rows], [p for _, p in rows]
        full = np.zeros(layout.size, dtype=np.int32)
        args = ([7] * len(rows), pos, tables, page, scratch)
        fill_decode_inputs(full, layout, *args)
        columns = fill_decode_inputs(memo_buf, layout, *args, written=memo)
        assert columns == max(p // page + 1 for p in pos)
        used = layout.prefix(columns)
        device[:used] = memo_buf[:used]  # what the graph runner copies to the device
        f_ids, f_pos, f_slots, f_lens, f_table = layout.views(full)
        for buf in (memo_buf, device):
            m_ids, m_pos, m_slots, m_lens, m_table = layout.views(buf)
            assert (f_slots == m_slots).all() and (f_lens == m_lens).all() and (f_pos == m_pos).all(), step
            for i, p in enumerate(pos):
                assert m_table[i, : p // page + 1].tolist() == tables[i][: p // page + 1], (step, i)
            assert (m_table[len(rows) :, 0] == scratch).all()


def test_fill_decode_inputs_rejects_what_does_not_fit():
    layout = DecodeLayout(batch=2, max_pages=2)
    buf = np.zeros(layout.size, dtype=np.int32)
    with pytest.raises(ValueError, match="batch of 2"):
        fill_decode_inputs(buf, layout, [1, 2, 3], [0, 0, 0], [[0], [1], [2]], 4, 5)
    with pytest.raises(ValueError, match="needs 3 pages"):
        fill_decode_inputs(buf, layout, [1], [8], [[0, 1, 2]], 4, 5)  # longer than the graph's table
    with pytest.raises(ValueError, match="needs 2 pages; it has 1"):
        fill_decode_inputs(buf, layout, [1], [4], [[0]], 4, 5)


def _tiny(path, **kw):
    return write_tiny_model(path, seed=5, **kw)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return load_model(_tiny(tmp_path_factory.mktemp("moe")), progress=False)


def test_graph_safety_needs_every_moe_to_say_so(moe_model):
    import copy

    assert not moe_model.graph_safe_decode()  # dense-weight experts count each expert's tokens on the host
    model = copy.deepcopy(moe_model)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    moes[0].experts.to_fp8()
    assert not model.graph_safe_decode()  # every MoE must be safe
    for m in moes[1:]:
        m.experts.to_fp8()
    assert model.graph_safe_decode()  # FP8 experts: masked layout, no host sync
    moes[0].ep = lambda x, ids, w: x
    assert not model.graph_safe_decode()  # expert parallel collectives are not captured
    assert not decode_graphs_supported(moe_model, "auto")  # CPU


def test_graphs_stay_off_on_cpu_and_for_unsafe_backends(moe_model):
    engine = Engine(moe_model, page_size=4, num_pages=32, cuda_graphs=True)
    assert engine.runner.graphs is None and engine.kv_pool.num_pages == 32  # no scratch page taken
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphRunner(
            moe_model, engine.kv_pool, TorchAttention(moe_model.config, moe_model.device), [1], 0, 4
        )


def test_a_failed_capture_turns_graphs_off_and_runs_eagerly(moe_model):
    engine = Engine(moe_model, page_size=4, num_pages=32)
    runner = engine.runner
    pages = engine.allocator.alloc(2)
    prompt = Chunk([5, 6, 7], 0, pages)
    runner.forward_last([prompt])
    decode = [Chunk([8], 3, pages)]
    expected = runner.forward_last(decode)

    class Uncapturable:
        def can_run(self, tokens, starts):
            return True

        def run(self, tokens, positions, page_tables):
            raise GraphCaptureError("host sync inside the captured region")

    runner.graphs = Uncapturable()  # type: ignore[assignment]
    torch.testing.assert_close(runner.forward_last(decode), expected)
    assert runner.graphs is None


def test_the_captured_step_body_on_padded_inputs_equals_eager_decode(moe_model):
    """What a graph replays, run eagerly on CPU: packed int32 inputs, 3 real rows padded to 4, the paged
    backend. Real rows' logits equal the eager decode step's; padding only writes the scratch page."""
    engine = Engine(moe_model, page_size=4, num_pages=32)
    runner, kv = engine.runner, engine.kv_pool
    tables = [engine.allocator.alloc(2) for _ in range(3)]
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
    runner.forward_last([Chunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    decode = [Chunk([40 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    expected = runner.forward_last(decode).clone()  # the torch reference backend
    before = kv.buffer.clone()
    scratch = 31  # never allocated here
    layout = DecodeLayout(batch=4, max_pages=3)
    buf = np.zeros(layout.size, dtype=np.int32)
    fill_decode_inputs(buf, layout, [40, 41, 42], [3, 5, 1], tables, 4, scratch)
    backend = TritonAttention(moe_model.config, moe_model.device, moe_model.dtype)
    step = static_step(torch.from_numpy(buf), layout, 4, backend)
    logits = moe_model.compute_logits(moe_model.forward_step(step, kv))
    torch.testing.assert_close(logits[:3], expected, atol=1e-5, rtol=1e-5)
    diff = (kv.buffer - before).abs().amax(dim=(0, 2))  # per slot, over layers and row values
    written = {t[p // 4] * 4 + p % 4 for t, p in zip(tables, [3, 5, 1], strict=True)}
    assert set(diff.nonzero().flatten().tolist()) <= written | {scratch * 4}
    assert diff[scratch * 4] > 0 and all(diff[s] < 1e-5 for s in written)  # the same rows, rewritten


# --- GPU ---

KERNEL_DIMS = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16, qk_nope_head_dim=32, v_head_dim=32
)
PREFILL_DIMS = KERNEL_DIMS | dict(qk_nope_head_dim=128, v_head_dim=128)  # DeepSeek-V3's 192 / 128 head dims
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [5, 6, 7, 40],
    [30, 31, 32, 33, 34],
]


def _engine_tokens(model, **kw):
    engine = Engine(model, page_size=16, num_pages=64, max_num_seqs=4, **kw)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    return [o.token_ids for o in outs], engine


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dims", [{}, KERNEL_DIMS], ids=["tiny-latent", "deepseek-latent"])
def test_greedy_with_graphs_equals_eager_and_cpu_float32(tmp_path, dims):
    # every layer dense: no MoE, so the model is graph-safe whatever the expert path
    path = _tiny(tmp_path, first_k_dense_replace=3, **dims)
    cpu_tokens, _ = _engine_tokens(load_model(path, progress=False))
    model = load_model(path, device="cuda", progress=False)
    eager, eager_engine = _engine_tokens(model, cuda_graphs=False)
    graphed, engine = _engine_tokens(model, cuda_graphs=True)
    assert eager_engine.runner.graphs is None
    assert engine.runner.graphs is not None and 4 in engine.runner.graphs.captured  # 3 sequences pad to 4
    assert engine.kv_pool.num_pages == 65 and engine.stats()["total_pages"] == 64  # the scratch page
    assert graphed == eager == cpu_tokens


def _decode_graph_vs_eager(model, prompts=PROMPTS, tol=1e-2, backend="triton", kv_cache_dtype="auto",
                           page_size=16) -> Engine:  # fmt: skip
    """Prefill the prompts eagerly, then the same decode step replayed from a graph (3 rows pad to 4; 4 do not) and
    eagerly: logits agree to `tol` (kernel choices and split-K counts follow the row count, so not
    bitwise), and a subset of rows gives the same rows."""
    engine = Engine(model, page_size=page_size, num_pages=64, max_num_seqs=8, attention_backend=backend,
                    kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    runner = engine.runner
    assert runner.backend.name == backend
    if backend == "triton":
        assert isinstance(runner.backend, TritonAttention) and runner.backend.kernel_cfg is not None
    assert runner.graphs is not None
    pages = engine.allocator.alloc(2 * len(prompts))
    tables = [pages[2 * i : 2 * i + 2] for i in range(len(prompts))]
    chunks = [Chunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    runner.forward_last(chunks)  # prefill, eager
    decode = [Chunk([7], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    graphed = runner.forward_last(decode).clone()
    assert runner.graphs.captured == [4]
    runner.graphs, saved = None, runner.graphs
    eager = runner.forward_last(decode)  # the same step again: it rewrites the same KV rows
    runner.graphs = saved
    assert _rel(graphed, eager) < tol
    want = runner.forward_last(decode, [True, False, True] + [False] * (len(prompts) - 3))
    assert want.shape[0] == 2 and torch.allclose(want, graphed[[0, 2]])
    return engine


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dims", ["kernel", "prefill"])
def test_flashinfer_decode_graph_replay_equals_eager(tmp_path, dims):
    """FlashInfer's MLA inside the decode graph, planned on the host before each replay. "kernel" dims (96/32
    expanded heads) prefill through SDPA (FlashInfer's ragged prefill does not compile for them: it failed
    here on the H200 before the backend checked); "prefill" dims are DeepSeek-V3's 192/128, FlashInfer's
    prefill too."""
    from libs.kernels import flashinfer_mla

    if not flashinfer_mla.available():
        pytest.skip("flashinfer is not installed")
    path = _tiny(tmp_path, first_k_dense_replace=3, **(KERNEL_DIMS if dims == "kernel" else PREFILL_DIMS))
    model = load_model(path, device="cuda", dtype="bfloat16", progress=False)
    _decode_graph_vs_eager(model, backend="flashinfer")


@pytest.mark.gpu
@gpu
def test_flashinfer_fp8_decode_graph_replay_equals_eager_over_tensor_rows(tmp_path):
    """kv_cache_dtype fp8_e4m3 with attention_backend "flashinfer" named: the pool holds "tensor" rows (576
    bytes) and FlashInfer's FP8 decode reads them, in the decode graph (planned before each replay) as eagerly;
    with "auto" the pool keeps "token" rows."""
    from libs.kernels import flashinfer_mla

    if not flashinfer_mla.available():
        pytest.skip("flashinfer is not installed")
    path = _tiny(tmp_path, first_k_dense_replace=3, **PREFILL_DIMS)
    model = load_model(path, device="cuda", dtype="bfloat16", progress=False)
    engine = _decode_graph_vs_eager(model, backend="flashinfer", kv_cache_dtype="fp8_e4m3")
    assert engine.kv_pool.fp8 is not None and engine.kv_pool.fp8.scales == "tensor"
    assert engine.kv_pool.format_name == "fp8_e4m3_tensor" and engine.kv_pool.row_width == 576
    assert engine.runner.backend.mla is not None
    auto = Engine(model, page_size=16, num_pages=8, kv_cache_dtype="fp8_e4m3")
    assert auto.kv_pool.format_name == "fp8_e4m3" and auto.runner.backend.mla is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["tensor", "token"])
def test_flashinfer_backend_decodes_fp8_rows_as_the_reference(layout):
    """FlashInfer's backend over FP8 rows == the torch absorbed reference over the same rows dequantized:
    "tensor" rows through FlashInfer's FP8 decode, "token" rows (another backend's pool) through the Triton
    FP8 kernel."""
    from libs.engine.kv_fp8 import Fp8Rows
    from libs.engine.layers.attention_backend import FlashInferAttention
    from libs.kernels import flashinfer_mla
    from tests.libs.engine.test_attention_backends import _batch, _cfg

    if not flashinfer_mla.available():
        pytest.skip("flashinfer is not installed")
    cfg = _cfg(**PREFILL_DIMS)
    batch = _batch([(0, 1), (37, 1), (200, 1), (63, 1)], num_pages=128)
    g = torch.Generator().manual_seed(2)
    h = cfg.num_attention_heads
    fmt = Fp8Rows(cfg.kv_lora_rank, cfg.qk_rope_head_dim, layout)
    raw = fmt.quantize(torch.randn(128 * 4, cfg.kv_row_dim, generator=g))
    w = torch.randn(h * 256, cfg.kv_lora_rank, generator=g) / 20
    q_nope, q_pe = torch.randn(4, h, 128, generator=g), torch.randn(4, h, 64, generator=g)
    ref = TorchAttention(cfg, torch.device("cpu"))
    rows = fmt.dequantize(raw, torch.float32)
    expected = ref.attend(q_nope, q_pe, rows, MLAWeights.from_dense(w, h, 128), ref.prepare(batch, 4, True))
    backend = FlashInferAttention(cfg, torch.device("cuda"), torch.bfloat16, "fp8_e4m3", layout == "tensor")
    assert (backend.mla is not None) == (layout == "tensor")
    q_nope, q_pe, w = (x.to("cuda", torch.bfloat16) for x in (q_nope, q_pe, w))
    got = backend.attend(q_nope, q_pe, raw.cuda(), MLAWeights.from_dense(w, h, 128), backend.prepare(batch, 4, True))
    assert _rel(got.cpu(), expected) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("schedule", ["auto", "seesaw"])
def test_sm90_fp8_decode_graph_replay_equals_eager(tmp_path, monkeypatch, schedule):
    """FP8 "token" rows on Hopper with 64 heads and 64-row pages: the SM90 Gluon kernel decodes them (its seesaw
    schedule with MOEMESH_MLA_FP8=seesaw), in the decode graph as eagerly (its FP8 probabilities follow the split
    count: a looser tolerance)."""
    from libs.kernels import mla_decode_fp8_sm90 as sm90
    from libs.kernels import mla_decode_fp8_sm90_seesaw as seesaw

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an SM90 GPU")
    monkeypatch.setenv("MOEMESH_MLA_FP8", schedule)
    module, name = (seesaw, "mla_decode_fp8_sm90_seesaw") if schedule == "seesaw" else (sm90, "mla_decode_fp8_sm90")
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    path = _tiny(tmp_path, first_k_dense_replace=3, **(KERNEL_DIMS | dict(num_attention_heads=64)))
    model = load_model(path, device="cuda", dtype="bfloat16", progress=False)
    engine = _decode_graph_vs_eager(model, tol=3e-2, kv_cache_dtype="fp8_e4m3", page_size=64)
    assert engine.kv_pool.format_name == "fp8_e4m3" and calls


@pytest.mark.gpu
@gpu
def test_bf16_kernel_decode_graph_replay_equals_eager(tmp_path):
    path = _tiny(tmp_path, first_k_dense_replace=3, **KERNEL_DIMS)
    _decode_graph_vs_eager(load_model(path, dtype="bfloat16", device="cuda", progress=False))


@pytest.mark.gpu
@gpu
def test_fp8_moe_decode_graph_replay_equals_eager(tmp_path):
    """FP8 experts (masked layout) captured: graph replay == eager decode to rounding, and a whole
    generation runs through the graphs. Greedy tokens of a random tiny model are not compared over many
    steps: near-tied logits flip on rounding differences (seen on the H200 at the 8th token).

    Four real rows, so graph and eager run the same shapes (with 3 rows padded to 4 the eager step picks
    other GEMM kernels, and in a random tiny FP8 model the rounding differences grow through 1x128 FP8
    activation rounding and flipped top-k experts: 6.8% on the H200). A replay of stale or wrong inputs
    gives uncorrelated logits (~140%)."""
    path = write_tiny_model(tmp_path, seed=5, fp8=True, moe_intermediate_size=128, **KERNEL_DIMS)
    model = load_model(path, dtype="bfloat16", device="cuda", progress=False)
    assert model.graph_safe_decode()
    _decode_graph_vs_eager(model, PROMPTS + [[50, 51, 52, 53, 54, 55]], tol=5e-2)
    eager, _ = _engine_tokens(model, cuda_graphs=False)
    graphed, engine = _engine_tokens(model, cuda_graphs=True)
    assert engine.runner.graphs is not None and engine.runner.graphs.captured
    assert [len(t) for t in graphed] == [len(t) for t in eager] == [8, 8, 8]
    assert [t[:2] for t in graphed] == [t[:2] for t in eager]  # prefill's token and the first decode step


def _ragged_case(dtype, seed=0):
    from tests.libs.engine.test_attention_backends import RAGGED, _batch, _cfg

    cfg = _cfg(**PREFILL_DIMS)
    batch = _batch(RAGGED + [(40, 24)], num_pages=64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    t, h = batch.input_ids.shape[0], cfg.num_attention_heads
    rows = torch.randn(64 * 4, cfg.kv_row_dim, generator=g)
    w = torch.randn(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, generator=g) / 20
    q_nope = torch.randn(t, h, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(t, h, cfg.qk_rope_head_dim, generator=g)
    ref = TorchAttention(cfg, torch.device("cpu"))
    ref_step = ref.prepare(batch, 4, absorbed=False)
    expected = ref.attend(q_nope, q_pe, rows, MLAWeights.from_dense(w, h, cfg.qk_nope_head_dim), ref_step)
    dev = [x.to("cuda", dtype) for x in (q_nope, q_pe, rows, w)]
    return cfg, batch, dev, expected


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
@pytest.mark.parametrize("one_query", [False, True], ids=["apart", "one-query"])
def test_prefill_backend_matches_expanded_reference_on_gpu(backend_name, one_query):
    """one_query: q_nope and q_pe as slices of one [T, H, N + r] tensor, as the fused path hands them over
    (taken whole, no copy)."""
    from libs.kernels import flashinfer_mla

    if backend_name == "flashinfer" and not flashinfer_mla.available():
        pytest.skip("flashinfer not installed")
    from libs.engine.layers.attention_backend import make_attention_backend

    cfg, batch, (q_nope, q_pe, rows, w), expected = _ragged_case(torch.bfloat16)
    if one_query:
        q = torch.cat([q_nope, q_pe], dim=-1)
        q_nope, q_pe = q[..., : q_nope.shape[-1]], q[..., q_nope.shape[-1] :]
    backend = make_attention_backend(backend_name, cfg, "cuda", torch.bfloat16)
    step = backend.prepare(batch, 4, absorbed=False)
    got = backend.attend(q_nope, q_pe, rows, MLAWeights.from_dense(w, cfg.num_attention_heads, 128), step)
    assert _rel(got.cpu(), expected) < 2e-2


@pytest.mark.gpu
@gpu
def test_decode_kernel_backend_matches_absorbed_reference_on_gpu():
    from tests.libs.engine.test_attention_backends import _batch, _cfg

    cfg = _cfg(**PREFILL_DIMS)
    batch = _batch([(0, 1), (37, 1), (200, 1), (63, 1)], num_pages=128)
    g = torch.Generator().manual_seed(1)
    h = cfg.num_attention_heads
    rows = torch.randn(128 * 4, cfg.kv_row_dim, generator=g)
    w = torch.randn(h * 256, cfg.kv_lora_rank, generator=g) / 20
    q_nope, q_pe = torch.randn(4, h, 128, generator=g), torch.randn(4, h, 64, generator=g)
    ref = TorchAttention(cfg, torch.device("cpu"))
    expected = ref.attend(q_nope, q_pe, rows, MLAWeights.from_dense(w, h, 128), ref.prepare(batch, 4, True))
    backend = TritonAttention(cfg, torch.device("cuda"), torch.bfloat16)
    assert backend.kernel_cfg is not None
    q_nope, q_pe, rows, w = (x.to("cuda", torch.bfloat16) for x in (q_nope, q_pe, rows, w))
    got = backend.attend(
        q_nope, q_pe, rows, MLAWeights.from_dense(w, h, 128), backend.prepare(batch, 4, True)
    )
    assert _rel(got.cpu(), expected) < 2e-2
