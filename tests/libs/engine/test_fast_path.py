"""The fused decoder path (libs/engine/layers/fast_path.py) against the plain path on the same FP8 weights:
logits close, greedy tokens equal, through prefill, decode and the engine's continuous batching.

Without CUDA the kernels run under Triton's interpreter (the kernel tests' conftest, imported first). The
config has DeepSeek's MLA dims (R 512, r 64, V 128) at a tiny width, so every fused kernel runs.
"""

from __future__ import annotations

# first, before anything imports triton: selects and patches the interpreter when there is no GPU
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import pytest
import torch

from libs.engine.engine import Engine
from libs.engine.loader import load_model
from libs.engine.sampling import SamplingParams, one_pass_ok
from libs.engine.tiny import write_tiny_model
from tests.libs.engine.fused_latent import PLAIN_BAND, fused_latent_rows, rms_rel

DEVICE = "cuda" if HAS_CUDA else "cpu"
# the interpreter multiplies bf16 as raw bits in places (see the kernel conftest): CPU runs float16
DTYPE = "bfloat16" if HAS_CUDA else "float16"
FAST = dict(
    hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    torch_dtype="bfloat16",
)  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 7], list(range(40, 61))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fast") / "m", seed=11, fp8=True, **FAST)


def _engine(ckpt, fast: bool, damp: bool = False) -> Engine:
    model = load_model(ckpt, dtype=DTYPE, device=DEVICE, progress=False, quantization="fp8")
    if damp:
        _damp(model)
    return Engine(
        model, page_size=16, num_pages=64, max_num_seqs=4, attention_backend="triton", cuda_graphs=False,
        fast_path=fast,
    )  # fmt: skip


def _damp(model, factor: float = 0.05) -> None:
    """Scale every layer's output projections down: a random model amplifies rounding noise layer by
    layer (each FP8 path is ~30% off a float32 reference at the last layer here), so two equally valid
    rounding orders may pick different greedy tokens; damped, the layers still run every kernel but the
    logits keep their margins. FP8 weights are scaled through their block scales, dense ones directly."""

    def scale(linear) -> None:
        target = linear.weight_scale_inv if linear.weight_scale_inv is not None else linear.weight
        target.data *= factor

    for layer in model.model.layers:
        scale(layer.self_attn.o_proj)
        mlp = layer.mlp
        if hasattr(mlp, "down_proj"):
            scale(mlp.down_proj)
        if getattr(mlp, "shared_experts", None) is not None:
            scale(mlp.shared_experts.down_proj)
        if hasattr(mlp, "experts"):
            ex = mlp.experts
            (ex.down_proj_scale_inv if ex.down_proj_scale_inv is not None else ex.down_proj).data *= factor


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module")
def fast(ckpt) -> Engine:
    return _engine(ckpt, fast=True)


@pytest.fixture(scope="module")
def plain(ckpt) -> Engine:
    return _engine(ckpt, fast=False)


def test_fast_path_is_taken_and_stacks_weights_as_views(fast):
    engine = fast
    model = engine.model
    assert model.fast is not None and engine.runner.model.uses_fast_path(engine.runner.backend)
    attn = model.model.layers[1].self_attn
    stacked, _ = attn.fast.qkv_a
    assert attn.q_a_proj.weight.data_ptr() == stacked.data_ptr()  # the Linears are row views of the stack
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == stacked[128:].data_ptr()
    moe = model.model.layers[1].mlp
    w13, _ = moe.fast.w13
    assert w13.shape[0] == 9 and moe.fast.shared_id == 8  # 8 routed experts, then the shared one
    assert moe.shared_experts.gate_up[0].data_ptr() == w13[8].data_ptr()
    assert moe.experts.gate_up_proj.data_ptr() == w13.data_ptr()


def test_fast_attention_layer_matches_the_plain_layer(fast):
    """One attention layer on the same input: the KV rows it writes are what the fused kernels' roundings give
    (recomputed in torch), and the output and the rows agree with the plain layer's to FP8 rounding (the
    fused kernels norm and rotate in float32, the plain path rounds in between)."""
    from libs.engine.layers import fast_path
    from libs.engine.runner import Chunk, build_batch
    from libs.kernels import fused

    engine = fast
    model, backend, kv = engine.model, engine.runner.backend, engine.kv_pool
    layer = model.model.layers[0]
    batch = build_batch([Chunk(PROMPTS[2], 0, [0, 1])], 16)
    x = torch.nn.functional.embedding(batch.input_ids.to(DEVICE), model.model.embed_tokens.weight)
    rows = slice(0, len(PROMPTS[2]))
    for absorbed in (False, True):  # prefill (expanded) and, over the same rows, the absorbed form
        step = backend.prepare(batch, 16, absorbed)
        cos, sin = model.rope.cos_sin(step.positions)
        ref = layer.self_attn(layer.input_layernorm(x), cos, sin, step, kv)
        ref_kv = kv.layer(0)[rows].clone()
        x8 = fused.add_rmsnorm_quant(x, layer.input_layernorm.weight, model.fast.eps)
        got = fast_path.attention(layer.self_attn, x8, step, kv, model.fast)
        assert _rel(got, ref) < 0.08  # bf16 on a GPU: 0.054 seen
        got_kv, fast = kv.layer(0)[rows], model.fast
        want = fused_latent_rows(layer.self_attn, x, layer.input_layernorm.weight, fast.eps, step.positions,
                                 fast.cos_sin)  # fmt: skip
        assert rms_rel(got_kv[:, :512], want[:, :512]) < 0.005  # normed latent: the fused kernels' roundings
        assert rms_rel(got_kv[:, 512:], want[:, 512:]) < 0.005  # roped k
        band = PLAIN_BAND[model.dtype]  # the plain path's roundings flip FP8 codes (fused_latent.py)
        assert _rel(got_kv[:, :512], ref_kv[:, :512]) < band
        assert _rel(got_kv[:, 512:], ref_kv[:, 512:]) < band


def test_fast_path_logits_are_as_close_to_float32_as_the_plain_path(tmp_path):
    """Against the float32 model on the dequantized weights (all damped alike), the fused path is no further
    off than the plain FP8 path (both round differently; neither is the other's reference). Every token
    takes every expert here: with top-2 of 8, a near-tie flips one token's expert between two equally valid
    roundings (measured: layer 2 of 3 parted by 3.5% where layers 0-1 agreed to 0.1-0.2%)."""
    config = FAST | dict(n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)
    ckpt = write_tiny_model(tmp_path / "m", seed=11, fp8=True, **config)
    ref_model = load_model(ckpt, device=DEVICE, progress=False, quantization="none")
    _damp(ref_model)
    ref = Engine(ref_model, page_size=16, num_pages=64)
    plain, fast = _engine(ckpt, fast=False, damp=True), _engine(ckpt, fast=True, damp=True)
    for prompt in PROMPTS:
        r = ref.prefill_logits(prompt)
        assert _rel(fast.prefill_logits(prompt), r) < 1.5 * _rel(plain.prefill_logits(prompt), r) + 0.02


def test_fast_path_greedy_tokens_equal_the_plain_path_under_continuous_batching(ckpt):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain_engine, fast_engine = _engine(ckpt, fast=False, damp=True), _engine(ckpt, fast=True, damp=True)
    plain, fast = plain_engine.generate(PROMPTS, params), fast_engine.generate(PROMPTS, params)
    for prompt, f, p in zip(PROMPTS, fast, plain, strict=True):
        split = next((k for k, (a, b) in enumerate(zip(f.token_ids, p.token_ids, strict=True)) if a != b), None)
        if split is None:  # equal (the zip is strict: both have max_tokens)
            continue
        # a split is a near-tie only: at that position the two paths' logits differ by more than the plain
        # path's gap between the two tokens (the H200 once split at the 6th token of 3x6)
        ctx = prompt + p.token_ids[:split]
        lp, lf = plain_engine.prefill_logits(ctx)[-1], fast_engine.prefill_logits(ctx)[-1]
        gap = (lp[p.token_ids[split]] - lp[f.token_ids[split]]).item()
        assert gap <= (lf - lp).abs().max().item(), (split, gap, f.token_ids, p.token_ids)
    assert sum(f.token_ids == p.token_ids for f, p in zip(fast, plain, strict=True)) >= len(PROMPTS) - 1


def test_fast_path_stays_off_where_the_model_cannot_take_it(ckpt, tmp_path):
    dense = load_model(ckpt, dtype="bfloat16", device=DEVICE, progress=False, quantization="none")
    assert not dense.enable_fast_path() and dense.fast is None  # dense (dequantized) projections
    f32 = load_model(ckpt, dtype="float32", device=DEVICE, progress=False, quantization="fp8")
    assert not f32.enable_fast_path()  # the fused kernels take 16-bit activations


def test_one_pass_sampler_rows():
    assert one_pass_ok(SamplingParams(temperature=0))
    assert one_pass_ok(SamplingParams(temperature=0.7, seed=3))
    assert not one_pass_ok(SamplingParams(temperature=0.7, top_p=0.9))
    assert not one_pass_ok(SamplingParams(temperature=0.7, top_k=20))
    assert not one_pass_ok(SamplingParams(temperature=0.7, min_p=0.1))
    assert one_pass_ok(SamplingParams(temperature=0, logprobs=True))  # the chosen token's: same pass
    assert one_pass_ok(SamplingParams(temperature=0.7, logprobs=True, seed=1))
    assert not one_pass_ok(SamplingParams(temperature=0, logprobs=True, top_logprobs=2))  # alternatives
    assert not one_pass_ok(SamplingParams(temperature=0, logprobs=3))
    assert not one_pass_ok(SamplingParams(temperature=0, logprobs=True, presence_penalty=0.5))  # raw != sampled


def test_one_pass_logprobs_are_the_exact_samplers():
    """The one-pass rows' logprobs (the kernel's online log-sum-exp) equal the exact sampler's
    log_softmax at the same tokens, and rows that do not ask get none."""
    from libs.engine.sampling import _logprobs, chosen_logprobs, one_pass_sample

    logits = (torch.randn(4, 3000) * 2).to(torch.bfloat16).to(DEVICE)
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0.8, logprobs=True),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0)]  # fmt: skip
    assert all(one_pass_ok(p) for p in params)
    ids, lps = one_pass_sample(logits, params, [(i, 5) for i in range(4)])
    assert lps is not None
    tokens = ids.tolist()
    got = chosen_logprobs(tokens, lps, params)
    want = _logprobs(logits, tokens, params)
    assert got[2] is None and got[3] is None and want[2] is None
    for g, w in zip(got[:2], want[:2], strict=True):
        assert g is not None and w is not None
        assert (g.token_id, g.top) == (w.token_id, w.top) and abs(g.logprob - w.logprob) < 1e-4
    assert one_pass_sample(logits[2:], params[2:], [(2, 5), (3, 5)])[1] is None  # nobody asked: no logprob work


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_a_prefill_step_waits_for_the_device_only_to_pick_its_tokens(fast, layout, monkeypatch):
    """A GPU forward that reads a device value back stalls until every kernel queued before it has run: the
    fused path's layers (MoE layout sized from the shapes, attention metadata from the host's lengths) and the
    runner (the rows that sample, as indices made on the host) read nothing back; the step's one wait is the
    sampler's. Both MoE layouts: these prompts take the masked one; long prompts (over MASKED_MAX_PAIRS pairs)
    the contiguous."""
    from libs.engine.layers import fp8_linear
    from tests.libs.engine.host_syncs import HostSyncs

    if layout == "contiguous":
        monkeypatch.setattr(fp8_linear, "MASKED_MAX_PAIRS", 0)

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        fast.add_request(f"syncs-{i}", prompt, params)
    with HostSyncs() as syncs:
        fast.step()  # one forward prefills all three
    while fast.has_unfinished():
        fast.step()
    where = [(call, site.split(":")[0]) for call, site in syncs.sites]
    assert where == [("tolist", "libs/engine/sampling.py")], syncs.sites
