"""Two-batch overlap (libs/engine/two_batch_overlap.py): the split and the schedule as pure functions, then
whole engines with it on and off on the same weights: the plain path (one rank, torch attention), the fused
path with an emulated EP rank (the Triton kernels, under the interpreter without CUDA), and on a GPU the
same under CUDA graphs. EP groups over threads and gloo: tests/libs/ep/test_two_batch_overlap_ep.py.

GPU run (the lead batches device runs): `pytest -q -m gpu tests/libs/engine/test_two_batch_overlap.py`.
"""

from __future__ import annotations

# first, before anything imports triton: selects and patches the interpreter when there is no GPU
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import copy
from pathlib import Path

import pytest
import torch

from libs.engine import Engine, SamplingParams, load_model
from libs.engine.tiny import write_tiny_model
from libs.engine.two_batch_overlap import check_backend, run_overlapped, split_index

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[(o + 11 * i) % 900 + 3 for i in range(n)] for o, n in ((1, 5), (2, 17), (3, 9), (4, 1), (5, 30))]


def test_decode_splits_in_half_and_extend_at_half_the_tokens() -> None:
    assert split_index([1] * 7) == 3 and split_index([1] * 256) == 128
    assert split_index([10, 10, 10, 10]) == 2
    assert split_index([30, 1, 1, 1]) == 1  # the long one alone is closest to half
    assert split_index([1, 2, 3, 30]) == 3
    assert split_index([5]) == 1 and split_index([]) == 0


def test_a_decode_round_holds_the_larger_micro_batch_of_any_batch_up_to_the_limit() -> None:
    """What an EP dispatcher sizes its fixed buffers by (libs/ep/rank.py, bench/decode_rank)."""
    from libs.engine.tbo_split import decode_round_tokens

    for limit in (1, 4, 7, 256):
        assert decode_round_tokens(limit, False) == limit
        parts = [max(s, b - s) for b in range(1, limit + 1) for s in [split_index([1] * b)]]
        assert max(parts) == decode_round_tokens(limit, True)


def _layer_trace(name: str, log: list[str], layers: int):
    """A micro-batch's stages as the model runs them: attention | dispatch launch | combine launch."""
    for j in range(layers):
        log.append(f"{name}{j}:attn")
        yield
        log.append(f"{name}{j}:D")
        yield
        log.append(f"{name}{j}:C")
        yield
    return name


def test_the_schedule_launches_rounds_in_sequential_order_and_overlaps_attention() -> None:
    """A's dispatch, A's combine, B's dispatch, B's combine per layer (the order idle EP ranks follow), with
    B's attention between A's dispatch launch and its wait, and A's next attention in B's dispatch flight."""
    log: list[str] = []
    assert run_overlapped(_layer_trace("a", log, 3), _layer_trace("b", log, 3)) == ("a", "b")
    launches = [e for e in log if e.endswith((":D", ":C"))]
    assert launches == [f"{m}{j}:{k}" for j in range(3) for m in "ab" for k in "DC"]
    assert log.index("a0:D") < log.index("b0:attn") < log.index("a0:C")
    assert log.index("b0:D") < log.index("a1:attn") < log.index("b0:C")


def test_backends_it_cannot_split_are_refused() -> None:
    class Planned:
        name = "other"

    with pytest.raises(ValueError, match="two-batch overlap"):
        check_backend(Planned())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tbo") / "tiny", seed=1)


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_plain_path_equal_with_and_without_tbo(tiny: Path, attention: str) -> None:
    """The reference metadata and the paged one (torch kernels on CPU), split for prefill and decode."""
    model = load_model(tiny, progress=False)
    off = Engine(model, num_pages=64, max_prefill_tokens=64, attention_backend=attention)
    on = Engine(copy.deepcopy(model), num_pages=64, max_prefill_tokens=64, attention_backend=attention,
                two_batch_overlap=True)  # fmt: skip
    assert [o.token_ids for o in on.generate(PROMPTS, GREEDY)] == [o.token_ids for o in off.generate(PROMPTS, GREEDY)]
    assert on.model.tbo.split_forwards > 0  # ragged prefill and decode batches were split
    for p in PROMPTS[:2]:
        torch.testing.assert_close(on.prefill_logits(p), off.prefill_logits(p), atol=1e-5, rtol=1e-5)


# 16 heads on a GPU, where the Triton MLA decode kernel (split-K per micro-batch size) then runs; 2 under the
# interpreter, which runs the paged torch decode either way
HEADS = 16 if HAS_CUDA else 2
FAST = dict(
    hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
    first_k_dense_replace=1, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=128,
    n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, vocab_size=600,
    max_position_embeddings=256,
)  # fmt: skip


def _emulated_rank(tbo: bool, device: str, dtype: torch.dtype, max_batch: int, attention: str = "triton"):
    """bench/decode_rank's engine (random FP8 weights, EP-8 emulated, fused path), KV pool seeded."""
    import bench.decode_rank as R
    from libs.engine.presets import deepseek_v3_config

    torch.manual_seed(0)  # the benchmark fills the KV pool with normal_()
    return R.build_engine(
        deepseek_v3_config(**FAST), ep=8, physical=16, max_batch=max_batch, max_ctx=64, device=device,
        dtype=dtype, attention=attention, page_size=16, two_batch_overlap=tbo,
    )  # fmt: skip


def _decode_tokens(engine: Engine, batch: int, steps: int) -> list[list[tuple[str, list[int]]]]:
    import bench.decode_rank as R

    R.fill(engine, batch, ctx=20, gen=4, seed=3)
    return [sorted((o.rid, o.token_ids) for o in engine.step()) for _ in range(steps)]


@pytest.mark.skipif(HAS_CUDA, reason="the GPU test below runs it under CUDA graphs")
def test_emulated_ep_rank_on_the_fused_path_equal_with_and_without_tbo() -> None:
    runs = [_decode_tokens(_emulated_rank(tbo, "cpu", torch.float16, 4), 3, 2) for tbo in (False, True)]
    assert runs[0] == runs[1] and all(len(step) == 3 for step in runs[0])


def _graph_logits(engine: Engine, rids: list[str]) -> torch.Tensor:
    """One decode forward of the requests through the runner (their captured graph on CUDA)."""
    from libs.engine.runner import Chunk

    reqs = [engine.requests[r] for r in rids]
    chunks = [Chunk([r.tokens[-1]], r.num_tokens - 1, r.pages) for r in reqs]
    return engine.runner.forward_last(chunks).float().clone()


def _padded_step_logits(engine: Engine, rids: list[str], bucket: int) -> torch.Tensor:
    """The decode graph's own inputs run eagerly: cuda_graph.static_step over the packed buffer of a batch
    padded to `bucket` rows (the padding writes and reads a page no request holds) -> the requests' logits."""
    import numpy as np

    from libs.engine.cuda_graph import DecodeLayout, fill_decode_inputs, plan_replay, static_step

    reqs = [engine.requests[r] for r in rids]
    held = {p for r in reqs for p in r.pages}
    scratch = next(p for p in range(engine.kv_pool.num_pages) if p not in held)
    layout = DecodeLayout(bucket, max(len(r.pages) for r in reqs))
    buf = np.zeros(layout.size, dtype=np.int32)
    fill_decode_inputs(buf, layout, [r.tokens[-1] for r in reqs], [r.num_tokens - 1 for r in reqs],
                       [r.pages for r in reqs], engine.page_size, scratch)  # fmt: skip
    plan_replay(engine.runner.backend, layout, torch.from_numpy(buf), engine.page_size)  # FlashInfer's plans
    step = static_step(torch.from_numpy(buf), layout, engine.page_size, engine.runner.backend)
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model.forward_step(step, engine.kv_pool))[: len(reqs)]


@pytest.mark.skipif(HAS_CUDA, reason="the GPU test below replays the captured graphs themselves")
def test_an_odd_batch_padded_as_its_decode_graph_pads_it_is_equal_with_and_without_tbo() -> None:
    """Batch 5 in the graph's inputs of size 8 (cuda_graph.static_step, run eagerly under the interpreter):
    TBO splits the padded rows 4 + 4, one real row and three padding rows in the second micro-batch. The five
    rows' logits must be those of the unpadded eager forward (split 2 + 3) and of TBO off, bit for bit:
    every kernel here computes a row from that row alone."""
    import bench.decode_rank as R

    logits = []
    for tbo in (False, True):
        engine = _emulated_rank(tbo, "cpu", torch.float16, 8)
        rids = R.fill(engine, 5, ctx=20, gen=4, seed=3)
        logits += [_graph_logits(engine, rids), _padded_step_logits(engine, rids, 8)]
        assert engine.model.tbo is None or engine.model.tbo.split_forwards == 2
    assert all(torch.equal(logits[0], other) for other in logits[1:])


class FakeFlashInferMLA:
    """flashinfer_mla.FlashInferMLA's interface over the paged torch decode: run() attends over the page table
    and lengths of its last plan, and refuses a batch of another size (a micro-batch run on the whole batch's
    wrapper or on the other micro-batch's)."""

    def __init__(self, device, backend="fa3", workspace_mb=256, *, workspace=None, graph_batch=None, max_pages=0):
        self.workspace = workspace if workspace is not None else torch.empty(0)
        self.graph_batch, self.planned = graph_batch, None

    def plan_host(self, seq_lens, page_table, page_size, num_heads, sm_scale, dtype=None, kv_dtype=None) -> None:
        assert seq_lens.shape[0] == self.graph_batch
        self.planned = (torch.from_numpy(page_table.copy()), torch.from_numpy(seq_lens.copy()), page_size, sm_scale)

    def plan(self, page_table, seq_lens, page_size, num_heads, sm_scale, dtype=None, kv_dtype=None) -> None:
        self.planned = (page_table.clone(), seq_lens.clone(), page_size, sm_scale)

    def run(self, q_nope, q_pe, kv_layer, out=None, kv_scale=1.0):
        from libs.engine.layers.mla import PagedMetadata, mla_decode_paged

        assert self.planned is not None
        table, lens, page_size, scale = self.planned
        assert q_nope.shape[0] == lens.shape[0], f"a batch of {q_nope.shape[0]} on a plan for {lens.shape[0]}"
        return mla_decode_paged(q_nope, q_pe, kv_layer, PagedMetadata(table, lens, page_size), scale)


@pytest.mark.skipif(HAS_CUDA, reason="FlashInfer itself needs the GPU run")
def test_flashinfer_decode_is_planned_per_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """TBO over the FlashInfer backend (its MLA wrapper faked by the paged torch decode, 16 heads so that the
    backend takes it): the eager split plans a wrapper per micro-batch, a decode graph's inputs (batch 5 padded
    to 8) get theirs from plan_graph, and the logits are those of TBO off and of the Triton backend."""
    import bench.decode_rank as R
    from libs.engine import two_batch_overlap
    from libs.engine.layers.attention_backend import FlashInferAttention
    from libs.engine.presets import deepseek_v3_config
    from libs.kernels import flashinfer_mla

    monkeypatch.setattr(flashinfer_mla, "FlashInferMLA", FakeFlashInferMLA)
    monkeypatch.setattr(flashinfer_mla, "ragged_prefill_fits", lambda *dims: False)
    torch.manual_seed(0)
    config = deepseek_v3_config(**{**FAST, "num_attention_heads": 16, "num_key_value_heads": 16})
    engine = R.build_engine(config, ep=8, physical=16, max_batch=8, max_ctx=64, device="cpu", dtype=torch.float16,
                            attention="triton", page_size=16)  # fmt: skip
    rids = R.fill(engine, 5, ctx=20, gen=4, seed=3)
    triton = _graph_logits(engine, rids)
    backend = FlashInferAttention(engine.config, torch.device("cpu"), torch.float16)
    assert backend.mla is not None
    engine.runner.backend = backend
    logits = [_graph_logits(engine, rids)]
    tbo = two_batch_overlap.enable(engine.model, backend)
    logits += [_graph_logits(engine, rids), _padded_step_logits(engine, rids, 8)]
    assert tbo.split_forwards == 2 and list(backend._graph_parts) == [8]
    assert [p.planned[1].shape[0] for p in backend._eager_parts] == [2, 3]
    assert [p.planned[1].shape[0] for p in backend._graph_parts[8]] == [4, 4]
    assert all(torch.equal(triton, other) for other in logits)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
@pytest.mark.parametrize("batch", [5, 16])
def test_emulated_ep_rank_under_cuda_graphs_equal_with_and_without_tbo(
    batch: int, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """World 1, the emulated EP rank on the fused path, decode replayed from CUDA graphs (the split forward
    captured, padded batches too), then engine steps with TBO on and off.

    Each micro-batch of the TBO graph is compared with the TBO-off graph over the same requests at the
    micro-batch's size (batch 5: captured size 8, micro-batches of 4 rows, the second one real row and three
    padding rows; TBO off runs those rows, filled up to 4 with other requests): the same shapes, so the same
    kernels (the GEMMs are tuned per bucket of M) and the same numbers but for the LM head, which sees the
    whole batch. Split-K is off here: its atomic adds sum in any order. Not compared within a bound: TBO on
    against off over the whole batch. Their GEMMs may run other kernels (M 4 against 8), and this random FP8
    model re-quantizes every projection's input to FP8, which turns a last-bit difference into a visible one:
    flipping the last bf16 bit of a quarter of the dense GEMM outputs moved its logits by 6-26% of their
    largest (CPU, the interpreter); the H200 run's 0.229 at batch 5 was that, not a wrong row. For the whole
    batch, the greedy tokens (near-ties aside)."""
    import bench.decode_rank as R
    from libs.engine.cuda_graph import bucket_for, capture_sizes
    from libs.kernels import fp8_gemm

    if attention == "flashinfer":
        pytest.importorskip("flashinfer")  # a planned MLA wrapper per micro-batch and graph size
    monkeypatch.setattr(fp8_gemm, "_measured_split", lambda *args: 1)
    engines = [_emulated_rank(tbo, "cuda", torch.bfloat16, 16, attention) for tbo in (False, True)]
    assert all(e.runner.backend.name == attention for e in engines)
    rids = [R.fill(e, batch, ctx=20, gen=4, seed=3) for e in engines]
    off, on = (_graph_logits(e, r) for e, r in zip(engines, rids, strict=True))
    assert all(e.runner.graphs is not None and e.runner.graphs.captured for e in engines)
    assert engines[1].model.tbo.split_forwards > 0
    half = split_index([1] * bucket_for(batch, capture_sizes(16)))
    for rows in (list(range(min(half, batch))), list(range(half, batch))):
        filler = [r for r in range(batch) if r not in rows][: half - len(rows)]
        alone = _graph_logits(engines[0], [rids[0][r] for r in rows + filler])[: len(rows)]
        assert ((on[rows] - alone).abs().max() / alone.abs().max()).item() < 2e-2, rows
    assert (on.argmax(-1) == off.argmax(-1)).float().mean().item() >= 0.8  # a near-tie may flip one row
    for e, r in zip(engines, rids, strict=True):
        for _ in range(3):
            assert sorted(o.rid for o in e.step()) in ([], sorted(r))  # overlapped decode reports one step late


def test_micro_batches_keep_the_whole_steps_split_k() -> None:
    """The Triton MLA decode's split count is the whole step's in both micro-batches, not re-chosen for half
    the sequences (which doubled it at B=256: two passes each with a combine where one wave did the work)."""
    from libs.engine.layers.attention_backend import StepInputs
    from libs.engine.layers.mla import PagedMetadata
    from libs.engine.two_batch_overlap import split_step

    class Backend:
        name = "triton"

        def num_splits(self, batch: int, max_kv: int) -> int:
            return 512 // batch  # more splits for fewer sequences, as choose_num_splits

    b, pages = 256, 40
    meta = PagedMetadata(torch.zeros(b, pages, dtype=torch.int32), torch.full((b,), 2000, dtype=torch.int32), 64,
                         Backend().num_splits(b, pages * 64))  # fmt: skip
    ids = torch.arange(b)
    step = StepInputs(ids, ids, ids, meta, Backend(), absorbed=True)  # type: ignore[arg-type]
    a, rest = split_step(step, split_index([1] * b))
    assert [p.meta.num_splits for p in (a, rest)] == [2, 2]
    assert [p.meta.seq_lens.shape[0] for p in (a, rest)] == [128, 128] and rest.input_ids[0].item() == 128
