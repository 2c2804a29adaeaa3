"""The MTP block on the fused decoder path (MTPLayer.enable_fast_path, libs/engine/layers/fast_path.py):
taken when the target takes it, its weights stacked as views, its draft step as close to the plain
block's as the fused target layers are to the plain ones, and MTPEngine drafting through it.

Without CUDA the kernels run under Triton's interpreter (the kernel tests' conftest, imported first)."""

from __future__ import annotations

# first, before anything imports triton: selects and patches the interpreter when there is no GPU
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import pytest
import torch

from libs.engine.runner import Chunk, build_batch
from libs.engine.sampling import SamplingParams
from libs.engine.speculative import MTPEngine
from libs.engine.tiny import write_tiny_model
from tests.libs.engine.fused_latent import PLAIN_BAND, fused_latent_rows, rms_rel

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = "bfloat16" if HAS_CUDA else "float16"  # the interpreter multiplies bf16 as raw bits in places
# DeepSeek's MLA dims at a tiny width; every token takes every expert (no near-tie expert flips)
FAST = dict(
    hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1,
    torch_dtype="bfloat16", num_nextn_predict_layers=1,
)  # fmt: skip


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> MTPEngine:
    path = write_tiny_model(tmp_path_factory.mktemp("mtp-fast") / "m", seed=11, fp8=True, **FAST)
    return MTPEngine.load(
        path, device=DEVICE, dtype=DTYPE, quantization="fp8", mtp_k=2, page_size=16,
        num_pages=32, max_num_seqs=4, attention_backend="triton", cuda_graphs=False, fast_path=True,
    )  # fmt: skip


def test_the_mtp_block_takes_the_fused_path_with_the_target(engine: MTPEngine) -> None:
    mtp = engine.mtp
    assert engine.model.fast is not None and mtp.fast is not None
    stacked, _ = mtp.self_attn.fast.qkv_a
    assert mtp.self_attn.q_a_proj.weight.data_ptr() == stacked.data_ptr()  # row views of one stack
    assert mtp.mlp.fast is not None and mtp.mlp.fast.shared_id == 4  # 4 routed experts, then the shared one


def test_fused_draft_step_matches_the_plain_block(engine: MTPEngine) -> None:
    """Prefill-shaped (expanded) and row-shaped (absorbed) steps: the fused block's latent rows are what its
    kernels' roundings give (recomputed in torch), and its hidden states and latent rows agree with the plain
    block's to FP8 rounding (tests/libs/engine/fused_latent.py derives the band)."""
    mtp, backend, pool = engine.mtp, engine.runner.backend, engine.mtp_pool
    assert mtp.fast is not None
    tokens = list(range(40, 61))
    band = PLAIN_BAND[engine.model.dtype]
    gen, d = torch.Generator().manual_seed(3), engine.config.hidden_size
    for chunks in ([Chunk(tokens, 0, [0, 1])], [Chunk([t], i, [0, 1]) for i, t in enumerate(tokens)]):
        batch = build_batch(chunks, 16)
        step = backend.prepare(batch, 16, batch.is_decode)
        hidden = torch.randn(len(tokens), d, generator=gen).to(DEVICE, engine.model.dtype)
        fast, mtp.fast = mtp.fast, None
        ref = mtp.draft_step(step, hidden, pool)
        ref_rows = pool.layer(0)[: len(tokens)].clone()
        mtp.fast = fast
        got = mtp.draft_step(step, hidden, pool)
        rows = pool.layer(0)[: len(tokens)]
        e = torch.nn.functional.embedding(step.input_ids, mtp.embed_tokens.weight)  # draft_step's block input
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden)], dim=-1))
        norm = mtp.input_layernorm.weight
        want = fused_latent_rows(mtp.self_attn, x, norm, fast.eps, step.positions, fast.cos_sin)
        assert rms_rel(rows[:, :512], want[:, :512]) < 0.005  # normed latent
        assert rms_rel(rows[:, 512:], want[:, 512:]) < 0.005  # roped k
        assert _rel(got, ref) < 0.08
        assert _rel(rows[:, :512], ref_rows[:, :512]) < band
        assert _rel(rows[:, 512:], ref_rows[:, 512:]) < band


def test_mtp_engine_drafts_through_the_fused_block(engine: MTPEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = engine.generate([[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 7]], params)
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert engine.num_drafted > 0
    engine.flush_prefix_cache()
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]
