"""Accuracy of the FP8 KV cache (kv_cache_dtype fp8_e4m3) against the plain cache, through the Engine.

    python -m bench.kv_fp8_accuracy                    # CPU: the demo model (held-out text) and tiny-v3
    python -m bench.kv_fp8_accuracy --model DIR --device cuda [--seqs 8 --prompt 512 --gen 64]
    python -m bench.kv_fp8_accuracy --model DIR --device cuda --attention-backend flashinfer   # "tensor" FP8 rows

Two Engines share one model, one with each cache. Each sequence runs teacher-forced through each engine's
runner as the engine runs it: the prompt as chunked prefill (expanded attention over the cached rows), then
one decode forward per token for every sequence together (absorbed attention: on CUDA the FP8-dot kernel
and decode graphs). Reported per model: logits error (mean relative L2 and max |diff|), argmax agreement,
KL(auto || fp8) per position, and perplexity of the text under each cache (meaningful on a trained model
only). `--formats` adds the format study that chose the row format: candidate FP8 rows emulated in the
torch reference (each row quantized and dequantized as it is written) on the same sequences.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import environment, write_results
from libs.engine import Engine
from libs.engine.batcher import pages_for
from libs.engine.kv_pool import KVPool
from libs.engine.layers.attention_backend import BACKENDS
from libs.engine.loader import load_model
from libs.engine.runner import Chunk

FP8 = torch.float8_e4m3fn


def teacher_forced(engine: Engine, seqs: list[list[int]], prompt_len: int, chunk: int) -> list[torch.Tensor]:
    """[len(seq) - 1, V] float32 logits of each sequence at every position but the last, on the host."""
    tables = [engine.allocator.alloc(pages_for(len(s), engine.page_size)) for s in seqs]
    try:
        out: list[list[torch.Tensor]] = [[] for _ in seqs]
        for i, (s, pages) in enumerate(zip(seqs, tables, strict=True)):
            for start in range(0, prompt_len, chunk):
                part = s[start : min(prompt_len, start + chunk)]
                out[i].append(engine.runner.forward_all(Chunk(part, start, pages)).float().cpu())
        for pos in range(prompt_len, max(len(s) for s in seqs) - 1):
            live = [i for i, s in enumerate(seqs) if pos < len(s) - 1]
            chunks = [Chunk([seqs[i][pos]], pos, tables[i]) for i in live]
            logits = engine.runner.forward_last(chunks).float().cpu()  # a graph's output: copied at once
            for row, i in enumerate(live):
                out[i].append(logits[row : row + 1])
        return [torch.cat(parts)[: len(s) - 1] for parts, s in zip(out, seqs, strict=True)]
    finally:
        for pages in tables:
            engine.allocator.free(pages)


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], seqs: list[list[int]]) -> dict:
    rel = [((g - r).norm(dim=-1) / r.norm(dim=-1)).mean().item() for r, g in zip(ref, got, strict=True)]
    n = sum(r.shape[0] for r in ref)
    agree = sum(int((r.argmax(-1) == g.argmax(-1)).sum()) for r, g in zip(ref, got, strict=True))
    kl = sum(
        F.kl_div(g.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum").item()
        for r, g in zip(ref, got, strict=True)
    )

    def ppl(logits: list[torch.Tensor]) -> float:
        nll = sum(F.cross_entropy(lg, torch.tensor(s[1:]), reduction="sum").item() for lg, s in zip(logits, seqs, strict=True))
        return math.exp(nll / n)

    p_ref, p_got = ppl(ref), ppl(got)
    return {
        "positions": n, "logits_rel_err_mean": sum(rel) / len(rel),
        "logits_max_abs_err": max((g - r).abs().max().item() for r, g in zip(ref, got, strict=True)),
        "argmax_agreement": agree / n, "kl_per_position": kl / n, "ppl_auto": p_ref, "ppl_fp8": p_got,
        "ppl_rel_change": p_got / p_ref - 1,
    }  # fmt: skip


def engines(model_dir: str, device: str, dtype: str, attention_backend: str = "auto") -> tuple[Engine, Engine]:
    model = load_model(model_dir, dtype=dtype, device=device, progress=False)
    kw = dict(page_size=16, num_pages=4096, max_num_seqs=64, max_prefill_tokens=4096, enable_prefix_cache=False,
              attention_backend=attention_backend)  # fmt: skip
    return Engine(model, kv_cache_dtype="auto", **kw), Engine(model, kv_cache_dtype="fp8_e4m3", **kw)


def text_windows(model_dir: str, n: int, length: int) -> list[list[int]]:
    """The demo model's held-out pydoc text in windows of `length` tokens (what its perplexity is measured on)."""
    from tokenizers import Tokenizer

    from libs.demo.pydoc_corpus import load_corpus
    from libs.demo.train import encode

    stream = encode(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")), load_corpus().held_out)
    n = min(n, len(stream) // length)
    return [stream[i * length : (i + 1) * length].tolist() for i in range(n)]


def random_tokens(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


# --- the format study: candidate rows emulated in the torch reference ---
def _q(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).to(FP8).float() * scale


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448


def candidates(latent: int) -> dict:
    """Candidate rows as quantize-dequantize of a row [..., R + r]; "chosen" is libs/engine/kv_fp8's."""
    from libs.engine.kv_fp8 import Fp8Rows

    def tiles(x):  # FlashMLA's 4 scales per row (1 x 128 tiles at R = 512), rope in bf16
        lat = x[..., :latent].unflatten(-1, (4, latent // 4))
        return torch.cat([_q(lat, _amax(lat)).flatten(-2), x[..., latent:].to(torch.bfloat16).float()], -1)

    def chosen(x):
        fmt = Fp8Rows(latent, x.shape[-1] - latent)
        return fmt.dequantize(fmt.quantize(x), torch.float32)

    lat, rope = slice(0, latent), slice(latent, None)
    return {
        "tensor_scale_1 (vLLM's default, no calibration)": lambda x: x.to(FP8).float(),
        "token_scale_whole_row": lambda x: _q(x, _amax(x)),
        "token_scales_latent_and_rope": lambda x: torch.cat([_q(x[..., lat], _amax(x[..., lat])),
                                                            _q(x[..., rope], _amax(x[..., rope]))], -1),  # fmt: skip
        "token_scale_latent_bf16_rope (chosen)": chosen,
        "tile4_scales_latent_bf16_rope (FlashMLA)": tiles,
        "bf16_rows": lambda x: x.to(torch.bfloat16).float(),
    }


class _EmulatedPool(KVPool):
    """A plain pool whose rows are rounded through a candidate format as they are written."""

    def __init__(self, pool: KVPool, roundtrip) -> None:
        super().__init__(pool.num_layers, pool.num_pages, pool.page_size, pool.row_dim, pool.row_dtype,
                         pool.buffer.device)  # fmt: skip
        self.roundtrip = roundtrip

    def write(self, layer_id: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        super().write(layer_id, slots, self.roundtrip(rows.float()))


def format_study(auto: Engine, seqs, prompt_len, chunk, ref) -> dict:
    out = {}
    real_pool = auto.runner.kv_pool
    for name, fn in candidates(auto.config.kv_lora_rank).items():
        pool = _EmulatedPool(real_pool, fn)
        auto.runner.kv_pool = pool  # the torch reference backend reads whatever pool the runner holds
        try:
            out[name] = compare(ref, teacher_forced(auto, seqs, prompt_len, chunk), seqs)
        finally:
            auto.runner.kv_pool = real_pool
    return out


def round_decode_query(engine: Engine) -> None:
    """The FP8-dot decode's query rounding (mla_decode_fp8.round_query_fp8: per head row to e4m3) in front of
    `engine`'s absorbed decode, for CPU runs whose decode is the torch one (backend "triton" without a GPU): the
    SM90 kernel's accuracy but for its FP8 probabilities."""
    from libs.kernels.mla_decode_fp8 import round_query_fp8

    backend = engine.runner.backend
    inner = backend.decode_latent

    def decode_latent(q_latent, q_pe, layer_rows, meta):
        return inner(round_query_fp8(q_latent).to(q_latent.dtype), q_pe, layer_rows, meta)

    backend.decode_latent = decode_latent


def interpret_fp8_dots(engine: Engine) -> None:
    """`engine`'s absorbed decode through the Triton FP8 kernel with "fp8" dots (mla_decode_fp8: the query and the
    probabilities in FP8, the SM90 kernels' arithmetic) run by the Triton interpreter on the CPU; heads padded
    to the kernel's 16-head block with zero queries (their outputs dropped)."""
    from libs.kernels import mla_decode_fp8 as kernel
    from libs.kernels.interpreter import patch_interpreter

    patch_interpreter()  # the interpreter's bf16 dots otherwise multiply raw bits
    backend = engine.runner.backend

    def decode_latent(q_latent, q_pe, layer_rows, meta):
        heads = q_latent.shape[1]
        pad = (0, 0, 0, -heads % 16)
        out = kernel.mla_decode_fp8(
            F.pad(q_latent, pad), layer_rows, meta.page_table.int(), meta.seq_lens.int(), meta.page_size,
            backend.scale, q_rope=F.pad(q_pe.to(q_latent.dtype), pad), dots="fp8",
        )  # fmt: skip
        return out[:, :heads]

    backend.decode_latent = decode_latent


def emulate_decode(engine: Engine, emulation: str | None) -> None:
    """None: the engine as it is; "query": round_decode_query; "kernel": interpret_fp8_dots. Both stand in for
    the torch absorbed decode of a CPU run (--attention-backend triton; "kernel" under TRITON_INTERPRET=1)."""
    if emulation is None:
        return
    backend = engine.runner.backend
    rows = engine.kv_pool.fp8
    if not hasattr(backend, "decode_latent") or backend.kernel_cfg is not None or rows is None or rows.scales != "token":
        raise ValueError(f"--fp8-{emulation} stands in for the torch absorbed decode over \"token\" FP8 rows: "
                         "--attention-backend triton on a CPU")  # fmt: skip
    if emulation == "kernel":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--fp8-kernel runs the Triton kernel in the Triton interpreter: set TRITON_INTERPRET=1")
        cfg = engine.model.config
        if (cfg.kv_lora_rank, cfg.qk_rope_head_dim) != (512, 64):
            raise ValueError(f"--fp8-kernel: the FP8 kernel reads DeepSeek-V3's 512 + 64-dim rows, this model's are "
                             f"{cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} (--fp8-query works at any width)")  # fmt: skip
        interpret_fp8_dots(engine)
    else:
        round_decode_query(engine)


def run_model(name, model_dir, device, dtype, seqs, prompt_len, chunk, formats, log, backend="auto",
              emulation=None) -> dict:  # fmt: skip
    t0 = time.perf_counter()
    auto, fp8 = engines(model_dir, device, dtype, backend)
    emulate_decode(fp8, emulation)
    ref = teacher_forced(auto, seqs, prompt_len, chunk)
    rec = {"model": name, "model_dir": str(model_dir), "device_arg": device, "dtype": dtype, "sequences": len(seqs),
           "prompt_tokens": prompt_len, "decode_tokens": len(seqs[0]) - 1 - prompt_len, "prefill_chunk": chunk,
           "attention_backend": fp8.runner.backend.name, "kv_format": fp8.kv_pool.format_name, "fast_path": fp8.model.fast is not None,
           "decode_graphs": fp8.runner.graphs is not None, "fp8_query_rounded": emulation is not None,
           "fp8_probabilities": emulation == "kernel",
           "fp8": compare(ref, teacher_forced(fp8, seqs, prompt_len, chunk), seqs)}  # fmt: skip
    f = rec["fp8"]
    log(f"{name} [{dtype}, {rec['attention_backend']}, {rec['kv_format']}]: rel err {f['logits_rel_err_mean']:.2e}, agreement "
        f"{f['argmax_agreement']:.4f} of {f['positions']}, KL {f['kl_per_position']:.2e}, ppl {f['ppl_auto']:.3f} -> "
        f"{f['ppl_fp8']:.3f} ({f['ppl_rel_change']:+.2%})")  # fmt: skip
    if formats:
        if auto.runner.backend.name != "torch" or device != "cpu":
            raise ValueError("--formats emulates candidate rows in the torch reference: run it on the CPU")
        rec["formats"] = format_study(auto, seqs, prompt_len, chunk, ref)
        for k, v in rec["formats"].items():
            log(f"  {k:48s} rel err {v['logits_rel_err_mean']:.2e}, agreement {v['argmax_agreement']:.4f}, "
                f"ppl {v['ppl_rel_change']:+.2%}")  # fmt: skip
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder; default: the demo model and tiny-v3 (CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seqs", type=int, default=0, help="sequences (default: 60 demo windows, 8 on a GPU)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence (chunked prefill)")
    ap.add_argument("--gen", type=int, default=64, help="teacher-forced decode tokens per sequence")
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk")
    ap.add_argument("--formats", action="store_true", help="also the row-format study (CPU, torch reference)")
    emu = ap.add_mutually_exclusive_group()
    emu.add_argument("--fp8-query", action="store_true",
                     help="round the FP8 engine's decode query as the FP8-dot kernels do (CPU, --attention-backend "
                     "triton): the SM90 kernel's accuracy but for its FP8 probabilities")  # fmt: skip
    emu.add_argument("--fp8-kernel", action="store_true",
                     help="decode the FP8 engine through the Triton FP8 kernel with FP8 dots (the SM90 kernels' "
                     "arithmetic) in the Triton interpreter: TRITON_INTERPRET=1, CPU, --attention-backend triton")  # fmt: skip
    ap.add_argument("--attention-backend", default="auto", choices=BACKENDS,
                    help="the FP8 rows follow it: FlashInfer's \"tensor\" rows with flashinfer named")  # fmt: skip
    a = ap.parse_args()
    emulation = "query" if a.fp8_query else "kernel" if a.fp8_kernel else None
    torch.manual_seed(0)
    length = a.prompt + a.gen + 1
    records = []

    def log(s):
        print(s, flush=True)

    if a.model is None:
        from libs.demo.cache import ensure_demo_model
        from libs.engine.tiny import write_tiny_model

        demo = ensure_demo_model()
        records.append(run_model("demo-v3", demo, a.device, a.dtype, text_windows(demo, a.seqs or 60, length),
                                 a.prompt, a.chunk, a.formats, log, a.attention_backend, emulation))  # fmt: skip
        tiny = Path.home() / ".cache" / "moemesh" / "tiny-v3"
        if not (tiny / "config.json").exists():
            write_tiny_model(tiny)
        vocab = load_model(tiny, progress=False).config.vocab_size
        records.append(run_model("tiny-v3 (random)", tiny, a.device, a.dtype, random_tokens(vocab, a.seqs or 16, length),
                                 a.prompt, a.chunk, a.formats, log, a.attention_backend, emulation))  # fmt: skip
    else:
        from libs.engine.config import ModelConfig

        vocab = ModelConfig.from_pretrained(a.model).vocab_size
        seqs = random_tokens(vocab, a.seqs or 8, length)
        records.append(run_model(Path(a.model).name, a.model, a.device, a.dtype, seqs, a.prompt, a.chunk, a.formats, log,
                                 a.attention_backend, emulation))  # fmt: skip
    env = environment()
    prefix = "TRITON_INTERPRET=1 " if emulation == "kernel" else ""
    for r in records:
        r.update({"benchmark": "kv_fp8_accuracy", "command": prefix + "python -m bench.kv_fp8_accuracy " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v not in (None, False, 0)), **env})  # fmt: skip
    tag = "cpu" if a.device == "cpu" else "gpu"
    print("wrote", write_results(f"kv_fp8_accuracy-{tag}", records))


if __name__ == "__main__":
    main()
