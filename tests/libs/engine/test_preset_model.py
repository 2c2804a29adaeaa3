"""Checkpoints of DeepSeek-V3 width (libs.engine.preset_model): the config at real width (pure), and a
narrowed folder written, read back in DeepSeek's FP8 layout and served by the Engine on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from libs.engine import Engine
from libs.engine.config import ModelConfig
from libs.engine.loader import load_model
from libs.engine.preset_model import preset_config, write_preset_model
from libs.engine.sampling import SamplingParams
from libs.engine.tiny import weight_shapes
from libs.quant.fp8 import FP8_DTYPE, dequantize_fp8_block

# V3's width narrowed so a test writes and loads it in well under a second
SMALL = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128,
    num_attention_heads=2, num_key_value_heads=2, vocab_size=2048,
)  # fmt: skip


def test_v3_width_config_and_size() -> None:
    c = preset_config("v3-width", layers=4, experts=16, top_k=8)
    ModelConfig.from_dict(c).validate()  # the engine accepts it
    assert (c["hidden_size"], c["num_attention_heads"], c["vocab_size"]) == (7168, 128, 129280)
    mla = (c["kv_lora_rank"], c["qk_rope_head_dim"], c["q_lora_rank"], c["qk_nope_head_dim"])
    assert mla == (512, 64, 1536, 128)
    assert (c["num_hidden_layers"], c["n_routed_experts"], c["num_experts_per_tok"]) == (4, 16, 8)
    assert c["first_k_dense_replace"] == 1 and c["num_nextn_predict_layers"] == 0
    assert c["quantization_config"]["weight_block_size"] == [128, 128]
    # bytes on disk: FP8 projections (+ scales), bf16 rest: two copies must fit one H200 with room for KV
    total = 0
    for name, shape in weight_shapes(c).items():
        n = math.prod(shape)
        total += n + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[-1] / 128) if "_proj" in name else 2 * n
    assert 5e9 < total < 10e9, total


def test_bad_presets_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("v4")
    with pytest.raises(ValueError, match="top_k"):
        preset_config(experts=4, top_k=8)
    with pytest.raises(ValueError, match="exceeds"):  # 8 groups of 1 expert, 4 groups chosen: at most 4
        preset_config(experts=8, top_k=8)
    with pytest.raises(ValueError, match="dense_layers"):
        preset_config(layers=2, dense_layers=3)
    with pytest.raises(ValueError, match="unknown DeepSeek-V3 config keys"):
        preset_config(hidden=7)


def test_written_folder_loads_and_serves(tmp_path) -> None:
    out = write_preset_model(
        tmp_path / "m", layers=3, experts=16, top_k=8, dense_layers=1, device="cpu", **SMALL
    )
    config = json.loads((out / "config.json").read_text())
    assert config == preset_config(layers=3, experts=16, top_k=8, dense_layers=1, **SMALL)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 + 2  # a shard per layer, embeddings, head
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    with safe_open(str(out / index["weight_map"][name]), "pt") as f:
        w, s = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
        assert f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.2.input_layernorm.weight").dtype == torch.bfloat16
    assert w.dtype == FP8_DTYPE and w.shape == (256, 128)
    assert s.dtype == torch.float32 and s.shape == (2, 1)
    assert torch.isfinite(w.float()).all()

    model = load_model(out, dtype="float32", device="cpu", progress=False)
    assert model.config.hidden_size == 256 and model.config.n_routed_experts == 16
    assert model.config.vocab_size == 2048
    expect = dequantize_fp8_block(w, s, (128, 128), torch.float32)
    experts = dict(model.named_parameters())["model.layers.2.mlp.experts.down_proj"]
    assert torch.equal(experts[5], expect)  # stacked experts, dequantized on CPU
    engine = Engine(model, max_num_seqs=4, num_pages=64)
    out_ids = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert len(out_ids) == 4 and all(0 <= t < 2048 for t in out_ids)


def test_same_seed_same_tensors(tmp_path) -> None:
    a = write_preset_model(
        tmp_path / "a", layers=1, experts=2, top_k=1, n_group=1, topk_group=1, device="cpu", **SMALL
    )
    b = write_preset_model(
        tmp_path / "b", layers=1, experts=2, top_k=1, n_group=1, topk_group=1, device="cpu", **SMALL
    )
    for file in sorted(p.name for p in a.glob("*.safetensors")):
        assert (a / file).read_bytes() == (b / file).read_bytes()
    with pytest.raises(ValueError, match="not empty"):
        write_preset_model(a, layers=1, device="cpu", **SMALL)


def test_cli_preset_errors_are_clear(tmp_path, capsys) -> None:
    from libs.cli.main import main

    out = str(tmp_path / "cli")
    assert main(["tiny-model", "--out", out, "--preset", "v3-width", "--experts", "4", "--top-k", "8"]) == 2
    assert "top_k" in capsys.readouterr().err
    assert (
        main(["tiny-model", "--out", out, "--preset", "v3-width", "--layers", "2", "--dense-layers", "3"])
        == 2
    )
    assert "dense_layers" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()  # nothing written before the config is known to be good
