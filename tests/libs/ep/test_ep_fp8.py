"""EPEngine with 2 and 4 gloo rank processes and FP8 experts (Triton's interpreter on CPU, the grouped GEMMs
the single-rank engine runs) against the single-rank FP8 Engine: ragged prefill logits within tolerance and
greedy tokens identical. The fixed-capacity dispatcher with FP8 dispatch carries the decode rounds (at most
max_num_seqs tokens per rank), its all-to-all fallback the longer prefill forwards. (The same checkpoint
dequantized gives logits 0.2-0.45 away from the FP8 engine's, so the tolerance tells FP8 experts apart.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.ep.engine import EPEngine
from tests.libs.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="CPU ranks under Triton's interpreter (gloo)")
pytest.importorskip("triton")

PAGES, SEQS = 24, 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [[(n + 7 * i) % 1000 + 3 for i in range(n)] for n in (6, 1, 3)]
# FP8 experts need widths in whole 128-row scale blocks; 2 layers (dense, MoE) and 8 experts keep the
# interpreter's work small
CONFIG = dict(
    num_hidden_layers=2, moe_intermediate_size=128, intermediate_size=128, n_routed_experts=8, n_group=2,
    topk_group=1, num_experts_per_tok=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ep-fp8") / "tiny", seed=1, fp8=True, **CONFIG)


@pytest.fixture(scope="module")
def ref(tiny_fp8: Path) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The single-rank FP8 engine's logits per prompt and greedy tokens (computed once for both groups)."""
    engine = Engine.from_pretrained(tiny_fp8, num_pages=PAGES, max_num_seqs=SEQS, quantization="fp8")
    assert engine.model.model.layers[1].mlp.experts.is_fp8
    logits = [engine.prefill_logits(p) for p in PROMPTS]
    return logits, [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def group(request: pytest.FixtureRequest, tiny_fp8: Path) -> Iterator[EPEngine]:
    with EPEngine(
        str(tiny_fp8), ep_size=request.param, num_pages=PAGES, max_num_seqs=SEQS, quantization="fp8", ep_backend="fixed",
        ep_fp8_dispatch=True, ep_timeout_s=120,
    ) as ep:  # fmt: skip
        yield ep


def test_fp8_ep_ragged_prefill_logits_are_within_tolerance_of_one_engine(group: EPEngine, ref) -> None:
    for want, got in zip(ref[0], group.prefill_logits_many(PROMPTS), strict=True):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_fp8_ep_greedy_tokens_equal_one_engine(group: EPEngine, ref) -> None:
    assert [o.token_ids for o in group.generate(PROMPTS, GREEDY)] == ref[1]
    stats = group.stats()
    assert stats["used_pages"] == 0 and stats["running"] == 0
