"""bench.kv_fp8_accuracy's CPU stand-ins for the FP8-dot decode: --fp8-kernel decodes the FP8 engine through the
Triton FP8 kernel in "fp8" dots under the interpreter (the SM90 kernels' arithmetic), every decode forward of
every layer, close to the plain cache's logits but not equal to the torch decode over the same rows; misuse is
refused with what to set."""

from __future__ import annotations

import pytest
import torch

from tests.libs.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="CPU stand-ins: a GPU runs the kernels themselves")


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b, strict=True))


def test_fp8_kernel_emulation_decodes_through_the_triton_fp8_kernel(tmp_path, monkeypatch):
    import bench.kv_fp8_accuracy as A
    from libs.engine.tiny import write_tiny_model
    from libs.kernels import mla_decode_fp8

    model = write_tiny_model(tmp_path / "tiny", kv_lora_rank=512, qk_rope_head_dim=64)  # the kernel's widths
    calls = []
    real = mla_decode_fp8.mla_decode_fp8
    monkeypatch.setattr(mla_decode_fp8, "mla_decode_fp8", lambda *a, **k: calls.append(k["dots"]) or real(*a, **k))
    auto, fp8 = A.engines(str(model), "cpu", "bfloat16", "triton")
    plain = A.engines(str(model), "cpu", "bfloat16", "triton")[1]  # the same FP8 rows, the torch decode
    A.emulate_decode(fp8, "kernel")
    seqs = A.random_tokens(auto.model.config.vocab_size, 2, 21)
    ref, got, torch_fp8 = (A.teacher_forced(e, seqs, 16, 8) for e in (auto, fp8, plain))
    layers = auto.model.config.num_hidden_layers
    assert calls == ["fp8"] * (4 * layers)  # 4 decode forwards (positions 16..19), every layer
    assert _rel(got, ref) < 0.1  # FP8 rows, query and probabilities: close to the plain cache
    assert _rel(got[:1], torch_fp8[:1]) > 0  # and not the torch decode over the same rows


def test_emulations_refuse_what_they_cannot_stand_in_for(tmp_path, monkeypatch):
    import bench.kv_fp8_accuracy as A
    from libs.engine.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    fp8 = A.engines(str(model), "cpu", "bfloat16", "triton")[1]
    with pytest.raises(ValueError, match="512 \\+ 64-dim rows"):  # this tiny model's latent is narrower
        A.emulate_decode(fp8, "kernel")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        A.emulate_decode(fp8, "kernel")
    auto = A.engines(str(model), "cpu", "bfloat16", "triton")[0]
    with pytest.raises(ValueError, match="token"):  # a bf16 cache has no FP8 decode to stand in for
        A.emulate_decode(auto, "query")
