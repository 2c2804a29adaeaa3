"""DeepSeek-V3's multi-token-prediction (MTP) module, the draft model of speculative decoding, as vLLM's and
SGLang's DeepSeek MTP run it: at position i, x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), g_i = block(x),
logits = head(norm(g_i)) predicts token i+2; chained drafting feeds g_i back as the next "hidden"."""

# Legend: T tokens, D hidden.
# A checkpoint with num_nextn_predict_layers: 1 stores it as layer num_hidden_layers: enorm, hnorm, eh_proj,
# a full decoder block, shared_head.norm, shared_head.head and its own embed_tokens. The block's latent KV
# lives in a one-layer pool page-aligned with the target's (same page ids and slots): one page table for both.

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from libs.engine.config import ModelConfig
from libs.engine.kv_pool import KVPool
from libs.engine.layers import fast_path
from libs.engine.layers.attention_backend import StepInputs, TritonAttention
from libs.engine.layers.fp8_linear import FP8_DTYPE, apply_fp8_weights
from libs.engine.models.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM, Embedding, Linear, RMSNorm
from libs.quant.fp8 import SCALE_SUFFIX

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")  # optional in a checkpoint


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)


class MTPLayer(DecoderLayer):
    """The MTP module; parameter names are the checkpoint's after `model.layers.<num_hidden_layers>.`.
    Its attention writes layer 0 of the MTP pool (`new_kv_pool`)."""

    def __init__(self, cfg: ModelConfig, rope, dtype: torch.dtype, device):
        super().__init__(cfg, rope, cfg.num_hidden_layers, dtype, device)
        self.self_attn.layer_id = 0
        self.config, self.rope = cfg, rope
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.eh_proj = Linear(2 * d, d, False, dtype, device)
        self.shared_head = SharedHead(cfg, dtype, device)
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype, device)
        # the fused decoder path, once enable_fast_path() said yes
        self.fast: fast_path.ModelFast | None = None

    def enable_fast_path(self, target: DeepseekV3ForCausalLM) -> bool:
        """Run this block on the fused decoder path (layers/fast_path.py) too, where the target takes it and
        the block allows it (FP8 attention projections, DeepSeek's MLA dims): `fast_path.enable` sees the
        block as a one-layer model and stacks its weights once, as it does the target's."""
        if self.fast is not None or target.fast is None:
            return self.fast is not None
        view = SimpleNamespace(
            model=SimpleNamespace(layers=[self]), config=self.config, dtype=target.dtype, device=target.device,
            rope=self.rope, fast=None,
        )  # fmt: skip
        if not fast_path.enable(view):
            return False
        self.fast = view.fast
        return True

    def new_kv_pool(self, target_pool: KVPool) -> KVPool:
        """A one-layer latent pool with the target pool's page geometry and row format."""
        t = target_pool
        return KVPool(1, t.num_pages, t.page_size, t.row_dim, t.row_dtype, t.buffer.device, t.fp8)

    @torch.inference_mode()
    def draft_step(self, step: StepInputs, hidden: torch.Tensor, kv: KVPool) -> torch.Tensor:
        """step.input_ids [T] are the tokens after the positions whose states `hidden` [T, D] holds ->
        this module's hidden [T, D] (before shared_head.norm), its latent rows written into `kv`."""
        e = F.embedding(step.input_ids, self.embed_tokens.weight)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))
        if self.fast is not None and isinstance(step.backend, TritonAttention):
            residual = torch.zeros_like(x)  # the fused layer adds its input in and carries the sum here
            h = fast_path.decoder_layer(self, x, residual, step, kv, self.fast)
            return h + residual
        cos, sin = self.rope.cos_sin(step.positions)
        return super().forward(x, cos, sin, step, kv)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, vocab] float32."""
        return F.linear(self.shared_head.norm(hidden), self.shared_head.head.weight).float()

    # --- weights ---
    def checkpoint_weight_names(self) -> set[str]:
        names = set()
        for name, param in self.named_parameters():
            if name == "mlp.experts.gate_up_proj":
                scaled = param.dtype == FP8_DTYPE
                for e in range(param.shape[0]):
                    for p in ("gate_proj", "up_proj", "down_proj"):
                        names.add(f"mlp.experts.{e}.{p}.weight")
                        if scaled:
                            names.add(f"mlp.experts.{e}.{p}.weight{SCALE_SUFFIX}")
            elif not name.startswith("mlp.experts."):
                names.add(name)
        return names

    def weight_target(self, name: str) -> torch.Tensor:
        m = _EXPERT.match(name)
        if m is None:
            return self.get_parameter(name)
        e, proj, scale = int(m.group(1)), m.group(2), m.group(3) or ""
        if proj == "down_proj":
            return self.get_parameter(f"mlp.experts.down_proj{scale}")[e]
        gate_up = self.get_parameter(f"mlp.experts.gate_up_proj{scale}")[e]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def mtp_prefix(cfg: ModelConfig) -> str:
    return f"model.layers.{cfg.num_hidden_layers}."


def load_mtp(
    path: str | Path, target: DeepseekV3ForCausalLM, quantization: str = "auto", progress: bool = False
) -> MTPLayer:
    """The checkpoint's first MTP module, on the target's device and dtype. FP8 weights follow
    `quantization` as the target's do (libs.engine.loader.load_model); an embedding or head the
    checkpoint leaves out is the target's (DeepSeek shares both)."""
    from libs.engine.loader import checkpoint_weight_map, iter_checkpoint_tensors, keeps_fp8

    folder, cfg = Path(path), target.config
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"{folder}: config.json has no MTP layer (num_nextn_predict_layers is 0)")
    prefix = mtp_prefix(cfg)
    weight_map = {n: f for n, f in checkpoint_weight_map(folder).items() if n.startswith(prefix)}
    if not weight_map:
        raise ValueError(f"{folder}: no tensors under {prefix!r} (the MTP layer is missing)")
    layer = MTPLayer(cfg, target.rope, target.dtype, target.device)
    keep: set[str] = set()
    if keeps_fp8(quantization, cfg, target.device):
        assert cfg.fp8_block_size is not None
        fp8 = {n[len(prefix) : -len(SCALE_SUFFIX)] for n in weight_map if n.endswith(SCALE_SUFFIX)}
        keep = {prefix + n for n in apply_fp8_weights(layer, fp8, cfg.fp8_block_size)}
    expected, loaded = layer.checkpoint_weight_names(), set()
    for name, tensor in iter_checkpoint_tensors(folder, cfg, progress, keep, weight_map):
        short = name[len(prefix) :]
        if short not in expected:
            raise ValueError(f"{folder}: unexpected MTP tensor {name}")
        target_param = layer.weight_target(short)
        if tuple(target_param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name}: shape {tuple(tensor.shape)}, expected {tuple(target_param.shape)}"
            )
        with torch.no_grad():
            target_param.copy_(tensor)
        loaded.add(short)
    if "embed_tokens.weight" not in loaded:
        layer.embed_tokens = target.model.embed_tokens
    if "shared_head.head.weight" not in loaded:
        layer.shared_head.head.weight = target.lm_head.weight
    missing = sorted(expected - loaded - set(_SHARED_WITH_TARGET))
    if missing:
        raise ValueError(f"{folder}: MTP layer is missing {len(missing)} tensors: {', '.join(missing[:8])}")
    return layer.eval()
