"""Train the demo model on the pydoc corpus and write it as a DeepSeek-V3 checkpoint folder."""

# `build_demo_model(out_dir)` trains the byte-level BPE tokenizer (libs/tokenizer/build.py) and the
# model (libs/demo/model.py) on the training paragraphs, measures the held-out loss, and writes
# config.json (DeepSeek's keys, `num_nextn_predict_layers: 1`), model.safetensors in DeepSeek's names
# (MTP module as layer `num_hidden_layers`), generation_config.json, the tokenizer files and
# `training.json` (settings, losses, wall time). Deterministic in the seed on one machine and torch build.
#
# Loss: next-token cross-entropy plus `mtp_weight` times the MTP module's t+2 cross-entropy, as DeepSeek-V3
# trains; expert load is balanced by the bias rule (no auxiliary loss).

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from libs.demo.model import DemoDeepseekV3
from libs.demo.pydoc_corpus import Corpus, load_corpus
from libs.engine.config import ModelConfig
from libs.engine.tiny import tiny_config
from libs.tokenizer.build import EOS_TOKEN, build_tokenizer, train_tokenizer

DEMO_VOCAB = 1024
# DeepSeek-V3's layout, shrunk to train in minutes on two CPU cores: 1 dense + 2 MoE layers + MTP.
DEMO_CONFIG: dict[str, Any] = dict(
    vocab_size=DEMO_VOCAB, hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.0,
    num_nextn_predict_layers=1, max_position_embeddings=4096,
)  # fmt: skip


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1500
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.01
    mtp_weight: float = 0.3
    bias_rate: float = 1e-3  # noaux_tc correction-bias step per balance
    seed: int = 0
    threads: int = 1  # on a small shared machine, more threads contend for the same cores
    config: tuple[tuple[str, Any], ...] = ()  # overrides of DEMO_CONFIG (tests shrink the model)

    def model_config(self) -> dict[str, Any]:
        return tiny_config(**(DEMO_CONFIG | dict(self.config)))


def encode(tokenizer, paragraphs: list[str]) -> torch.Tensor:
    """One token stream: each paragraph as BOS + text + EOS."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(paragraphs):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.int64)


def _lr(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def losses(model: DemoDeepseekV3, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [B, T+1] -> (next-token CE, MTP t+2 CE or None), both means over positions."""
    logits, mtp_logits = model(ids[:, :-1])
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    if mtp_logits is None:
        return main, None
    return main, F.cross_entropy(mtp_logits.reshape(-1, vocab), ids[:, 2:].reshape(-1))


@torch.no_grad()
def evaluate(model: DemoDeepseekV3, stream: torch.Tensor, seq_len: int) -> dict[str, float]:
    """Mean held-out CE over consecutive windows of the stream (every token predicted once)."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    windows = torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    main_sum = mtp_sum = 0.0
    for batch in windows.split(16):
        main, mtp = losses(model, batch)
        main_sum += float(main) * len(batch)
        mtp_sum += float(mtp) * len(batch) if mtp is not None else 0.0
    model.train()
    for moe in model.moes():
        moe.load.zero_()
    return {"loss": main_sum / n, "ppl": math.exp(main_sum / n), "mtp_loss": mtp_sum / n}


def train(
    corpus: Corpus, settings: TrainSettings, log: Callable[[str], None] = print
) -> tuple[DemoDeepseekV3, Any, dict[str, Any]]:
    """-> (trained model, tokenizer, metrics)."""
    torch.set_num_threads(settings.threads)
    start = time.perf_counter()
    cfg_dict = settings.model_config()
    tokenizer = train_tokenizer(cfg_dict["vocab_size"], corpus.train)
    train_ids, held_ids = encode(tokenizer, corpus.train), encode(tokenizer, corpus.held_out)
    model = DemoDeepseekV3(ModelConfig.from_dict(cfg_dict), settings.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(settings.seed)
    span = settings.seq_len + 1
    for step in range(settings.steps):
        starts = torch.randint(0, len(train_ids) - span, (settings.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + span] for s in starts.tolist()])
        main, mtp = losses(model, batch)
        loss = main if mtp is None else main + settings.mtp_weight * mtp
        for group in opt.param_groups:
            group["lr"] = _lr(step, settings)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for moe in model.moes():
            moe.balance(settings.bias_rate)
        if step % 50 == 0 or step == settings.steps - 1:
            mtp_text = f" mtp {float(mtp.detach()):.3f}" if mtp is not None else ""
            log(
                f"step {step:4d}  loss {float(main.detach()):.3f}{mtp_text}  {time.perf_counter() - start:6.0f}s"
            )
    train_seconds = time.perf_counter() - start
    held = evaluate(model, held_ids, settings.seq_len)
    log(f"held-out loss {held['loss']:.3f} (perplexity {held['ppl']:.1f}), MTP loss {held['mtp_loss']:.3f}")
    metrics = {
        "held_out": held, "train_seconds": round(train_seconds, 1), "train_tokens": len(train_ids),
        "held_out_tokens": len(held_ids), "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "corpus_digest": corpus.digest, "torch": torch.__version__, "settings": asdict(settings),
    }  # fmt: skip
    return model, tokenizer, metrics


def write_checkpoint(out: Path, model: DemoDeepseekV3, cfg_dict: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict_hf(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    generation = {"_from_model_config": True, "bos_token_id": cfg_dict["bos_token_id"], "eos_token_id": 1}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build_demo_model(
    out_dir: str | Path, settings: TrainSettings | None = None, log: Callable[[str], None] = print
) -> Path:
    """Train and write the demo checkpoint folder into out_dir (files replaced); return its path."""
    settings = settings or TrainSettings()
    corpus = load_corpus()
    model, _, metrics = train(corpus, settings, log)
    out = Path(out_dir)
    cfg_dict = settings.model_config()
    write_checkpoint(out, model, cfg_dict)
    build_tokenizer(
        out, cfg_dict["max_position_embeddings"], vocab_size=cfg_dict["vocab_size"], texts=corpus.train
    )
    (out / "training.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return out


def quick_settings(**changes: Any) -> TrainSettings:
    """Tiny settings for tests: a small model trained for a few steps."""
    small = (("hidden_size", 64), ("intermediate_size", 96), ("moe_intermediate_size", 32),
             ("q_lora_rank", 32), ("kv_lora_rank", 32), ("vocab_size", 1024))  # fmt: skip
    return replace(TrainSettings(steps=3, batch_size=2, seq_len=32, warmup=1, config=small), **changes)
