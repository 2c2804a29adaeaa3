import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from libs.cli.main import main
from libs.engine.tiny import QUANTIZATION_CONFIG, SHARD_NAMES, is_fp8_weight, write_tiny_model
from libs.tokenizer import Tokenizer


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in SHARD_NAMES:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert index["weight_map"][name] == file
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_fp8"), seed=0, fp8=True)


def test_folder_layout_and_config(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in config
    assert config["vocab_size"] == Tokenizer.from_pretrained(tiny).vocab_size
    assert "quantization_config" not in config
    tensors = _tensors(tiny)
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"].values()) == set(SHARD_NAMES)  # really two shards
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # first_k_dense_replace=1: layer 0 dense
    assert tensors["model.layers.2.mlp.experts.15.down_proj.weight"].shape == (128, 64)
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].std() > 0.01
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == 1


def test_loads_in_transformers_and_output_varies(tiny: Path) -> None:
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(tiny, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (
        model.config.rope_parameters["rope_type"] == "yarn" and model.config.rope_parameters["factor"] == 4.0
    )
    stored = _tensors(tiny)
    state = model.state_dict()
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]  # transformers fuses the per-expert tensors
    assert torch.equal(gate_up[5, :64], stored["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, 64:], stored["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(state["lm_head.weight"], stored["lm_head.weight"])
    tok = Tokenizer.from_pretrained(tiny)
    prompt = torch.tensor([tok.encode_chat([{"role": "user", "content": "Hello! How are you?"}])])
    out = model.eval().generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    generated = out[0, prompt.shape[1] :].tolist()
    assert len(set(generated)) >= 12  # greedy output is not stuck on a token or a short loop
    with torch.no_grad():
        probs = model(prompt).logits[0].softmax(-1)
    assert 0.01 < probs.max(-1).values.mean() < 0.9  # neither flat nor one-hot


def _dequantize(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    full = scale_inv.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return w.to(torch.float32) * full


def test_fp8_dtypes_scales_and_values(tiny: Path, tiny_fp8: Path) -> None:
    assert json.loads((tiny_fp8 / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    ref, q = _tensors(tiny), _tensors(tiny_fp8)
    assert set(q) == set(ref) | {n + "_scale_inv" for n in ref if is_fp8_weight(n)}
    quantized = [n for n in ref if is_fp8_weight(n)]
    assert "model.layers.0.self_attn.kv_b_proj.weight" in quantized and "lm_head.weight" not in quantized
    for name, w in ref.items():
        if not is_fp8_weight(name):
            assert q[name].dtype == torch.float32 and torch.equal(q[name], w), name
            continue
        fp8, scale = q[name], q[name + "_scale_inv"]
        assert fp8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert scale.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)), name
        assert fp8.to(torch.float32).abs().amax() == 448.0  # the block holding the amax uses the full range
        err = (_dequantize(fp8, scale) - w).abs()
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal step near zero
        bound = w.abs() * 2**-4 + scale.max() * 2**-9
        assert (err <= bound).all(), name
        assert err.norm() / w.norm() < 0.05, name


def test_seed_and_overrides(tmp_path: Path, tiny: Path) -> None:
    again = write_tiny_model(tmp_path / "again", seed=0)
    for name in (*SHARD_NAMES, "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    other = _tensors(write_tiny_model(tmp_path / "seed1", seed=1))
    assert not torch.equal(other["lm_head.weight"], _tensors(tiny)["lm_head.weight"])
    lite = _tensors(
        write_tiny_model(tmp_path / "lite", q_lora_rank=None, tie_word_embeddings=True, n_group=2)
    )
    assert "model.layers.0.self_attn.q_proj.weight" in lite and "lm_head.weight" not in lite
    with pytest.raises(ValueError, match="unknown config keys.*hidden_sise"):
        write_tiny_model(tmp_path / "typo", hidden_sise=64)
    with pytest.raises(ValueError, match="not empty"):
        write_tiny_model(tiny)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_tiny_model(tmp_path / "small", vocab_size=10)


def test_cli_writes_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["tiny-model", "--out", str(out), "--seed", "3", "--fp8"]) == 0
    assert str(out) in capsys.readouterr().out
    assert _tensors(out)["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert main(["tiny-model", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["tiny-model", "--out", str(out), "--force"]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
