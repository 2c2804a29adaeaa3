"""Checkpoint loading: shards, half precision, DeepSeek FP8, MTP/legacy extras, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.engine.kv_pool import KVPool
from libs.engine.loader import load_model
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.quant.fp8 import FP8_DTYPE, dequantize_fp8_block, fp8_quantization_config, quantize_state_dict
from tests.libs.engine.hf_utils import hf_model, make_hf_checkpoint, rewrite_config

PROMPT = [5, 17, 300, 2, 999, 41, 7, 7, 123, 64, 8]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("src"), seed=21)


def _logits(model: DeepseekV3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    from libs.engine.forward_batch import ForwardBatch

    cfg, n = model.config, len(tokens)
    kv = KVPool(cfg.num_hidden_layers, 8, 4, cfg.kv_row_dim)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(n), torch.arange(n), [n], [n], [torch.arange(8)])
    return model.compute_logits(model(batch, kv))


def _hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([tokens])).logits[0]


def _clone(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if tensors is None:
        tensors = load_file(src / "model.safetensors")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _same_params(a: DeepseekV3ForCausalLM, b: DeepseekV3ForCausalLM) -> None:
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, pb[name]), name


def test_sharded_checkpoint_with_index(source: Path, tmp_path: Path) -> None:
    hf_model(source).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    _same_params(load_model(tmp_path, progress=False), load_model(source, progress=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(source: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {k: v.to(dtype) for k, v in load_file(source / "model.safetensors").items()}
    path = _clone(source, tmp_path, tensors)
    ours = _logits(load_model(path, progress=False), PROMPT)  # upcast to the fp32 model
    assert (ours - _hf_logits(path, PROMPT)).abs().max() <= 1e-4


@pytest.mark.parametrize("block", [(128, 128), (16, 8)])
def test_fp8_checkpoint_matches_dequantized_reference(
    source: Path, tmp_path: Path, block: tuple[int, int]
) -> None:
    quantized = quantize_state_dict(load_file(source / "model.safetensors"), block)
    assert sum(t.dtype == FP8_DTYPE for t in quantized.values()) > 20
    # DeepSeek's layout, sharded so that every scale lives in a different file from its weight
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    shutil.copy(source / "config.json", fp8_dir)
    rewrite_config(fp8_dir, quantization_config=fp8_quantization_config(block))
    shards: dict[str, dict[str, torch.Tensor]] = {
        "model-00001-of-00002.safetensors": {},
        "model-00002-of-00002.safetensors": {},
    }
    for name, t in quantized.items():
        shards[
            "model-00002-of-00002.safetensors"
            if name.endswith("_scale_inv")
            else "model-00001-of-00002.safetensors"
        ][name] = t
    for file, tensors in shards.items():
        save_file(tensors, fp8_dir / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (fp8_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )

    dequantized = {
        n: dequantize_fp8_block(t, quantized[n + "_scale_inv"], block) if t.dtype == FP8_DTYPE else t
        for n, t in quantized.items()
        if not n.endswith("_scale_inv")
    }
    ref_dir = _clone(source, tmp_path / "ref", dequantized)
    ours = load_model(fp8_dir, progress=False)
    assert ours.config.fp8_block_size == block
    _same_params(ours, load_model(ref_dir, progress=False))
    assert (_logits(ours, PROMPT) - _hf_logits(ref_dir, PROMPT)).abs().max() <= 1e-4


def test_mtp_layers_and_legacy_buffers_are_skipped(source: Path, tmp_path: Path) -> None:
    tensors = load_file(source / "model.safetensors")
    n_layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{n_layers}.eh_proj.weight"] = torch.zeros(64, 128)  # DeepSeek's MTP module
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    path = _clone(source, tmp_path, tensors)
    rewrite_config(path, num_nextn_predict_layers=1)
    _same_params(load_model(path, progress=False), load_model(source, progress=False))
    rewrite_config(path, num_nextn_predict_layers=0)
    with pytest.raises(
        ValueError, match=rf"1 unexpected tensors: model\.layers\.{n_layers}\.eh_proj\.weight"
    ):
        load_model(path, progress=False)


def test_tied_head_checkpoint_may_still_carry_lm_head(tmp_path: Path) -> None:
    path = make_hf_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    model = load_model(path, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    _same_params(load_model(_clone(path, tmp_path / "with_head", tensors), progress=False), model)


def _drop(t: dict) -> None:
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]


def _extra(t: dict) -> None:
    t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)


def _reshape(t: dict) -> None:
    t["model.norm.weight"] = torch.zeros(65)


def _int(t: dict) -> None:
    t["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)


def _fp8_no_scale(t: dict) -> None:
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(FP8_DTYPE)


def _orphan_scale(t: dict) -> None:
    t["model.layers.0.mlp.up.weight_scale_inv"] = torch.ones(1, 1)


def _bad_scale(t: dict) -> None:
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(FP8_DTYPE)
    t["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 3)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_drop, r"missing 1 tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"),
        (_extra, r"1 unexpected tensors: model\.layers\.0\.self_attn\.extra\.weight"),
        (_reshape, r"tensor model\.norm\.weight: checkpoint shape \(65,\), model expects \(64,\)"),
        (_int, r"model\.norm\.weight has unsupported dtype torch\.int32"),
        (_fp8_no_scale, r"FP8 tensor model\.layers\.0\.mlp\.up_proj\.weight has no .*_scale_inv"),
        (_orphan_scale, r"FP8 scales without a weight: model\.layers\.0\.mlp\.up\.weight_scale_inv"),
        (_bad_scale, r"tensor model\.layers\.0\.mlp\.up_proj\.weight: FP8 scale has shape \(3, 3\)"),
    ],
)
def test_bad_tensors_are_named(source: Path, tmp_path: Path, mutate, message: str) -> None:
    tensors = load_file(source / "model.safetensors")
    mutate(tensors)
    with pytest.raises(ValueError, match=message):
        load_model(_clone(source, tmp_path, tensors), progress=False)


def test_broken_folders_are_clear_errors(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(empty)
    shutil.copy(source / "config.json", empty)
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(empty)

    garbage = _clone(source, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="cannot open safetensors shard"):
        load_model(garbage, progress=False)

    truncated = _clone(source, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="safetensors"):
        load_model(truncated, progress=False)

    indexed = _clone(source, tmp_path / "indexed")
    index = indexed / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="lists shards that are not in the folder: model-00002-of-00002"):
        load_model(indexed, progress=False)
    index.write_text("{")
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        load_model(indexed, progress=False)

    with pytest.raises(ValueError, match="unsupported model dtype 'int8'"):
        load_model(source, dtype="int8")
