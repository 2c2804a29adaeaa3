"""FP8 checkpoints kept in FP8 (quantization="fp8"): modules, the MoE's two layouts, the whole model against
transformers on the dequantized weights, and loader errors.

Without CUDA the Triton kernels run under the interpreter: the kernel tests' conftest (imported first, so
TRITON_INTERPRET is set before libs.kernels is) patches it as those tests need. Dims are multiples of 128
where the kernels need them, except the dense MLP's width (192), which keeps its down projection dense.
"""

from __future__ import annotations

# first, before anything imports triton: selects and patches the interpreter when there is no GPU
from tests.libs.kernels.conftest import HAS_CUDA

# isort: split
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.engine.forward_batch import ForwardBatch
from libs.engine.kv_pool import KVPool
from libs.engine.loader import load_model
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.engine.tiny import write_tiny_model
from libs.quant.fp8 import FP8_DTYPE, dequantize_fp8_block
from tests.libs.engine.hf_utils import hf_model
from tests.libs.engine.test_attention_backends import _rel

DEVICE = "cuda" if HAS_CUDA else "cpu"
# kernels vs torch: float32 rounding under the interpreter; a GPU's FP8 tensor cores accumulate each
# 128-wide K block with fewer mantissa bits (DeepSeek-V3 report: ~14), so allow that there
TIGHT = 2e-3 if HAS_CUDA else 1e-5
TINY = dict(
    hidden_size=256, intermediate_size=192, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
)  # fmt: skip


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    """A tiny FP8 checkpoint in DeepSeek's layout (two shards, fan-in scaled random weights) and the same
    weights dequantized, for transformers' oracle and the dense engine."""
    root = tmp_path_factory.mktemp("fp8_engine")
    fp8 = write_tiny_model(root / "fp8", seed=3, fp8=True, **TINY)
    quantized = _tensors(fp8)
    dequantized = {
        n: dequantize_fp8_block(t, quantized[n + "_scale_inv"]) if t.dtype == FP8_DTYPE else t
        for n, t in quantized.items()
        if not n.endswith("_scale_inv")
    }
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    return {"fp8": fp8, "ref": _write(root / "ref", config, dequantized)}


@pytest.fixture(scope="module")
def fp8_model(ckpt) -> DeepseekV3ForCausalLM:
    return load_model(ckpt["fp8"], device=DEVICE, progress=False, quantization="fp8")


def _assert_tight(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to float32 summation-order rounding, relative to each row's largest value."""
    err = ((got.float() - ref.float()).abs() / (1 + ref.float().abs().amax(-1, keepdim=True))).max().item()
    assert err < TIGHT, f"max row-relative error {err:.1e}"


def _assert_same_math(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Kernels vs the torch reference through two quantizations: float32 summation order moves a SwiGLU
    output across an e4m3 rounding boundary now and then, and that one element's 1/16 step shows in its
    row (measured: ~1 row in 40, 1e-3 of the row's largest value); everything else is float32-equal."""
    row = 1 + ref.float().abs().amax(-1, keepdim=True)
    err = (got.float() - ref.float()).abs() / row
    assert err.max().item() < 4e-3, f"max row-relative error {err.max().item():.1e}"
    rows_off = (err > TIGHT).any(-1).float().mean().item()
    assert rows_off <= 0.1, f"{rows_off:.0%} of rows differ beyond float32 rounding"


def _act_quant_reference(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: 1x128 groups quantized to e4m3 and back."""
    g = x.float().unflatten(-1, (-1, 128))
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
    return ((g / s).to(FP8_DTYPE).float() * s).flatten(-2)


def test_fp8_modules_are_kept_and_fall_back_where_kernels_cannot(ckpt, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="moemesh.engine"):
        model = load_model(ckpt["fp8"], device=DEVICE, progress=False, quantization="fp8")
    layer0, layer1 = model.model.layers
    attn = layer0.self_attn
    assert attn.q_a_proj.weight.dtype == FP8_DTYPE and attn.q_a_proj.weight_scale_inv.shape == (1, 2)
    assert attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (2, 2)  # N = 144: a partial row block
    assert attn.kv_b_proj.weight.dtype == torch.float32  # MLA's matrix: dequantized at load
    assert layer0.mlp.gate_proj.is_fp8 and not layer0.mlp.down_proj.is_fp8  # down: K = 192
    assert "model.layers.0.mlp.down_proj stays dequantized (K=192" in caplog.text
    ex = layer1.mlp.experts
    assert ex.gate_up_proj.dtype == FP8_DTYPE and ex.gate_up_proj_scale_inv.shape == (8, 2, 2)
    assert ex.down_proj_scale_inv.shape == (8, 2, 1) and layer1.mlp.shared_experts.down_proj.is_fp8
    # the experts' scales landed in the stacked tensors: gate rows, then up rows
    raw = _tensors(ckpt["fp8"])
    up = raw["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    assert torch.equal(ex.gate_up_proj_scale_inv[5, 1:].cpu(), up)
    shared_up = raw["model.layers.1.mlp.shared_experts.up_proj.weight"]  # fused gate/up: up rows second
    shared = layer1.mlp.shared_experts
    assert torch.equal(shared.gate_up[0][128:].cpu().view(torch.uint8), shared_up.view(torch.uint8))
    assert model.lm_head.weight.dtype == torch.float32
    ref = load_model(ckpt["ref"], progress=False)
    dense = attn.q_b_proj.dense_weight()
    assert dense is attn.q_b_proj.dense_weight()  # cached
    torch.testing.assert_close(dense.cpu(), ref.model.layers[0].self_attn.q_b_proj.weight, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # SiLU of the x50 row, in numpy
def test_fp8_linear_and_mlp_equal_the_torch_math(fp8_model) -> None:
    """(a) module outputs == 1x128 activation quant + dequantized weight, in float32 torch."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 256, generator=gen).to(DEVICE)
    x[3] *= 50  # one token with a much larger range: its groups get their own scales
    attn = fp8_model.model.layers[0].self_attn
    for lin in (attn.q_a_proj, attn.kv_a_proj_with_mqa):
        ref = _act_quant_reference(x) @ lin.dense_weight().T
        _assert_tight(lin(x), ref)
    mlp = fp8_model.model.layers[1].mlp.shared_experts
    assert mlp.is_fp8 and mlp.gate_proj.weight.data_ptr() == mlp.gate_up[0].data_ptr()  # fused gate/up
    xq = _act_quant_reference(x)
    gate, up = xq @ mlp.gate_proj.dense_weight().T, xq @ mlp.up_proj.dense_weight().T
    h = _act_quant_reference(torch.nn.functional.silu(gate) * up)
    _assert_tight(mlp(x), h @ mlp.down_proj.dense_weight().T)


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_moe_masked_equals_contiguous_equals_reference(fp8_model, tokens: int) -> None:
    """(c) decode layout == prefill layout == the torch math, on the model's MoE layer and router."""
    from libs.kernels.backend import fp8_moe, fp8_moe_reference

    moe = fp8_model.model.layers[1].mlp
    ex = moe.experts
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    weights, ids = moe.gate(x)
    w13, w2 = (ex.gate_up_proj, ex.gate_up_proj_scale_inv), (ex.down_proj, ex.down_proj_scale_inv)
    shared = moe.shared_experts(x)
    masked = fp8_moe(x, ids, weights, w13, w2, shared, masked=True)
    contiguous = fp8_moe(x, ids, weights, w13, w2, shared, masked=False, block_m=16)
    ref = fp8_moe_reference(x, ids, weights, w13, w2, shared)
    _assert_tight(masked, contiguous)  # measured: bit-equal under the interpreter
    _assert_same_math(masked, ref)
    _assert_tight(moe(x), masked)  # fused router, same experts
    # and the unquantized-activation float math: FP8 activation error only
    float_ref = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        wg = dequantize_fp8_block(ex.gate_up_proj[e].cpu(), ex.gate_up_proj_scale_inv[e].cpu()).to(x.device)
        wd = dequantize_fp8_block(ex.down_proj[e].cpu(), ex.down_proj_scale_inv[e].cpu()).to(x.device)
        g, u = (x[tok] @ wg.T).chunk(2, dim=-1)
        float_ref.index_add_(0, tok, weights[tok, slot, None] * (torch.nn.functional.silu(g) * u) @ wd.T)
    assert _rel(masked - shared, float_ref) < 6e-2  # measured 4.2-4.7%: two e4m3 roundings (x, SwiGLU)


def _logits(model: DeepseekV3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    cfg, n = model.config, len(tokens)
    kv = KVPool(cfg.num_hidden_layers, 8, 4, cfg.kv_row_dim, device=model.device)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(n), torch.arange(n), [n], [n], [torch.arange(8)])
    return model.compute_logits(model(batch, kv)).cpu()


def test_model_logits_close_to_transformers_on_dequantized_weights(ckpt, fp8_model) -> None:
    """(b) the FP8 model vs the same weights dequantized, run by transformers. The gap is activation
    quantization alone (the dense engine on those weights is within 1e-4): every projection's input
    rounded to e4m3 (~2.6% each on these Gaussian-like activations), compounded through two layers.
    Measured on four 32-token prompts: 5-11% relative, argmax equal on 87-97% of positions."""
    hf = hf_model(ckpt["ref"])
    dense = load_model(ckpt["ref"], progress=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        prompt = torch.randint(2, fp8_model.config.vocab_size, (32,), generator=gen).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (_logits(dense, prompt) - ref).abs().max() < 1e-4  # the oracle setup itself
        ours = _logits(fp8_model, prompt)
        assert _rel(ours, ref) < 0.15
        agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.8, f"argmax agrees on {agree:.0%} of positions"


def test_quantization_modes(ckpt) -> None:
    assert not load_model(ckpt["fp8"], progress=False).model.layers[0].mlp.gate_proj.is_fp8  # auto, CPU
    none = load_model(ckpt["fp8"], device=DEVICE, progress=False, quantization="none")
    assert none.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    with pytest.raises(ValueError, match="needs an FP8 checkpoint"):
        load_model(ckpt["ref"], progress=False, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(ckpt["ref"], progress=False, quantization="int4")


def test_expert_parallel_hook_on_fp8_experts_gets_the_picks_and_the_shared_expert(fp8_model) -> None:
    """An EP rank's FP8 MoE hands its hook the router's picks and the shared expert's output (`add`): a hook
    that runs the local grouped FP8 experts on them gives the MoE's own output (libs/ep runs dispatch ->
    grouped GEMMs -> combine there)."""
    moe = fp8_model.model.layers[1].mlp
    x = torch.randn(5, 256, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    want = moe(x)
    seen = []

    def hook(x, ids, weights, add=None):
        seen.append(add is not None)
        return moe.experts(x, ids, weights, add=add)

    moe.ep = hook
    try:
        torch.testing.assert_close(moe(x), want, atol=0, rtol=0)
        assert (
            seen == [moe.shared_experts is not None] and not moe.graph_safe
        )  # a plain hook is not graph-safe
    finally:
        moe.ep = None


def _broken(ckpt: dict[str, Path], tmp_path: Path, edit) -> Path:
    tensors = _tensors(ckpt["fp8"])
    edit(tensors)
    return _write(tmp_path / "broken", json.loads((ckpt["fp8"] / "config.json").read_text()), tensors)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
            r"FP8 tensor model\.layers\.0\.self_attn\.o_proj\.weight has no .*_scale_inv",
        ),
        (
            lambda t: t.pop("model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"),
            r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight has no",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(2, 2)}),
            r"tensor model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv: checkpoint shape \(2, 2\), "
            r"model expects \(1, 2\)",
        ),
        (
            lambda t: t.update({"model.layers.1.mlp.experts.4.up_proj.weight_scale_inv": torch.ones(1, 3)}),
            r"tensor model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight_scale_inv: checkpoint shape \(1, 3\)",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(192, 256)}),
            r"tensor model\.layers\.0\.mlp\.up_proj\.weight has a _scale_inv but dtype torch\.float32",
        ),
    ],
)
def test_bad_fp8_tensors_are_value_errors_naming_them(ckpt, tmp_path: Path, edit, error: str) -> None:
    """(d) missing scales, scales of the wrong shape, a non-FP8 weight with a scale."""
    with pytest.raises(ValueError, match=error):
        load_model(_broken(ckpt, tmp_path, edit), progress=False, quantization="fp8")


def test_engine_generates_with_fp8_weights_consistently_with_prefill(ckpt) -> None:
    """Engine end to end in FP8: greedy decode steps (absorbed attention, one token per step) pick the
    tokens a full prefill over the same sequence ranks first (quantization is per token, so batch shape
    does not change the math)."""
    from libs.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(
        ckpt["fp8"], device=DEVICE, dtype="float32", quantization="fp8", max_num_seqs=2
    )
    assert engine.model.model.layers[1].mlp.experts.is_fp8
    prompt = [0, 17, 300, 2, 999, 41, 7, 123]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    logits = engine.prefill_logits(prompt + out.token_ids[:-1])
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == out.token_ids


def test_moe_layout_choice_by_batch_shape() -> None:
    from libs.engine.layers.fp8_linear import use_masked_moe

    assert use_masked_moe(512, 8, 256)  # DeepSeek-V3 decode at batch 512, all experts on one GPU
    assert not use_masked_moe(513, 8, 256)
    assert use_masked_moe(1024, 8, 4)  # an EP rank's 4 local experts: up to 8192 token-expert pairs
    assert not use_masked_moe(2000, 8, 4)  # a prefill chunk: contiguous
