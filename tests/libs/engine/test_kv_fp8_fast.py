"""On a GPU: the FP8 KV cache on the fused decoder path (FP8 weights, the fused FP8 row write, the FP8-dot decode
kernel) against the plain cache on the same model, and inside decode graphs and the overlapped decode. (On CPU
the interpreter takes minutes here: tests/bench/test_decode_rank_smoke.py runs this path at a toy size.)"""

from __future__ import annotations

# first, before anything imports triton: selects and patches the interpreter when there is no GPU
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import pytest
import torch

from libs.engine.engine import Engine
from libs.engine.loader import load_model
from libs.engine.runner import Chunk
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import write_tiny_model
from tests.libs.engine.test_fast_path import FAST, _damp

DEVICE, DTYPE = "cuda", "bfloat16"
# 16 heads: the FP8 decode kernel's head tile (FAST's 2 would take the torch paged decode)
CONFIG = FAST | dict(num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=2)
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], list(range(40, 61))]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.fixture(scope="module")
def model(tmp_path_factory):  # only GPU tests use it
    path = write_tiny_model(tmp_path_factory.mktemp("fp8kv") / "m", seed=11, fp8=True, **CONFIG)
    m = load_model(path, dtype=DTYPE, device=DEVICE, progress=False, quantization="fp8")
    _damp(m)  # margins a random model keeps through rounding (test_fast_path says why)
    return m


def _engine(model, kv_cache_dtype: str, **kw) -> Engine:
    kw = dict(page_size=16, num_pages=32, max_num_seqs=4, attention_backend="triton", fast_path=True) | kw
    return Engine(model, kv_cache_dtype=kv_cache_dtype, **kw)


@pytest.mark.gpu
@gpu
def test_fused_path_over_fp8_rows_tracks_the_plain_cache(model):
    """Decode logits through the fused FP8 write and the FP8-dot kernel stay within a few percent of the same
    engine over bf16 rows (FP8 q and rows: a few percent; a wrong scale or row layout is ~100%), and the first
    decode tokens agree."""
    auto, fp8 = _engine(model, "auto", cuda_graphs=False), _engine(model, "fp8_e4m3", cuda_graphs=False)
    assert model.fast is not None and fp8.kv_pool.fp8 is not None and fp8.runner.backend.kernel_cfg is not None
    rel = []
    for engine in (auto, fp8):
        pages = engine.allocator.alloc(4)
        tables = [pages[:2], pages[2:]]
        engine.runner.forward_last([Chunk(p, 0, t) for p, t in zip(PROMPTS, tables, strict=True)])
        rel.append(engine.runner.forward_last([Chunk([7], len(p), t) for p, t in zip(PROMPTS, tables, strict=True)]))
        engine.allocator.free(pages)
    err = ((rel[1].float() - rel[0].float()).norm(dim=-1) / rel[0].float().norm(dim=-1)).max().item()
    assert err < 0.1, err
    assert (rel[0].argmax(-1) == rel[1].argmax(-1)).all()


@pytest.mark.gpu
@gpu
def test_fp8_decode_graphs_and_the_overlapped_decode_give_the_eager_tokens(model):
    """Decode graphs over FP8 rows (the FP8 kernel and the fused write captured, padding rows into the scratch
    page) and the overlapped decode give the eager engine's greedy tokens."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = PROMPTS + [[300, 2, 2, 7]]
    eager = _engine(model, "fp8_e4m3", cuda_graphs=False)
    graphed = _engine(model, "fp8_e4m3", overlap=False)
    overlapped = _engine(model, "fp8_e4m3")
    want = [o.token_ids for o in eager.generate(prompts, params)]
    for engine in (graphed, overlapped):
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        assert engine.runner.graphs is not None and engine.runner.graphs.captured
    assert overlapped._overlap is not None
    torch.cuda.synchronize()
