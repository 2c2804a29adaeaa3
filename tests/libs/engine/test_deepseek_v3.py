"""DeepseekV3ForCausalLM against transformers on random tiny checkpoints (fp32).

A small paged driver (scattered pages, several sequences per forward) stands in for the runtime, so
these tests exercise the model's contract: ragged prefill, chunked prefill, shared prefix pages,
batched absorbed decode, sequences joining and leaving between steps.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.forward_batch import ForwardBatch
from libs.engine.kv_pool import KVPool
from libs.engine.loader import load_model
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from tests.libs.engine.hf_utils import hf_model, make_hf_checkpoint

PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CONFIGS = {
    "v3_yarn": dict(seed=0),
    "v3_groups_dense": dict(
        seed=1, first_k_dense_replace=2, num_hidden_layers=4, n_routed_experts=16, n_group=2, topk_group=1,
        num_experts_per_tok=3, n_shared_experts=2, bias_std=0.5, routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                         "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "v3_noq_tied_plain": dict(
        seed=2, q_lora_rank=None, tie_word_embeddings=True, n_group=1, topk_group=1, norm_topk_prob=False,
        first_k_dense_replace=0, rope_parameters=PLAIN_ROPE,
    ),
    "v2_lite_greedy": dict(
        seed=3, arch="deepseek_v2", q_lora_rank=None, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, n_shared_experts=2,
    ),
    "v2_group_limited": dict(
        seed=4, arch="deepseek_v2", topk_method="group_limited_greedy", n_routed_experts=16, n_group=4,
        topk_group=2, num_experts_per_tok=4, norm_topk_prob=False, routed_scaling_factor=4.0,
    ),
}  # fmt: skip
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict[str, tuple[DeepseekV3ForCausalLM, object]] = {}

    def get(name: str):
        if name not in cache:
            path = make_hf_checkpoint(tmp_path_factory.mktemp(name), **CONFIGS[name])
            cache[name] = (load_model(path, progress=False), hf_model(path))
        return cache[name]

    return get


class Driver:
    """Minimal paged runtime: scattered pages per sequence, one ForwardBatch per step."""

    def __init__(self, model: DeepseekV3ForCausalLM, num_pages: int = 128, page_size: int = 4, seed: int = 0):
        cfg = model.config
        self.model, self.page_size = model, page_size
        self.kv = KVPool(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_row_dim)
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def share_prefix(self, seq: str, source: str, num_pages: int) -> None:
        self.tables[seq] = self.tables[source][:num_pages]
        self.lens[seq] = num_pages * self.page_size
        self.tokens[seq] = self.tokens[source][: self.lens[seq]]

    def step(self, chunks: dict[str, list[int]], attn_mode: str = "auto") -> dict[str, torch.Tensor]:
        ids, pos, slots, ext, seq_lens, tables = [], [], [], [], [], []
        for seq, new in chunks.items():
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.page_size < start + len(new):
                table.append(self.free.pop())
            p = list(range(start, start + len(new)))
            ids += new
            pos += p
            slots += [table[i // self.page_size] * self.page_size + i % self.page_size for i in p]
            ext.append(len(new))
            seq_lens.append(start + len(new))
            tables.append(torch.tensor(table))
            self.lens[seq] = start + len(new)
            self.tokens[seq] = self.tokens.get(seq, []) + new
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), ext, seq_lens, tables)
        logits = self.model.compute_logits(self.model(batch, self.kv, attn_mode))
        return dict(zip(chunks, logits.split(ext), strict=True))


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max |logit diff| {diff:.2e} > {atol:.0e}"


@pytest.mark.parametrize("attn_mode", ["expanded", "absorbed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ragged_prefill_matches_transformers(models, name: str, attn_mode: str) -> None:
    ours, hf = models(name)
    prompts = _prompts(ours.config.vocab_size, [7, 1, 23, 12], seed=len(name))
    out = Driver(ours).step({f"s{i}": p for i, p in enumerate(prompts)}, attn_mode)
    for i, p in enumerate(prompts):
        _assert_close(out[f"s{i}"], _hf_logits(hf, p))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_decode_with_joins_and_leaves_matches_full_recompute(models, name: str) -> None:
    ours, hf = models(name)
    vocab = ours.config.vocab_size
    drv = Driver(ours, seed=1)
    prompts = _prompts(vocab, [5, 11, 2, 9], seed=7)
    drv.step({"a": prompts[0], "b": prompts[1], "c": prompts[2]})
    gen = torch.Generator().manual_seed(8)
    running = ["a", "b", "c"]
    for step in range(8):
        chunks = {s: [int(torch.randint(2, vocab, (1,), generator=gen))] for s in running}
        if step == 3:
            running.remove("b")  # leaves; its pages stay untouched
            del chunks["b"]
        if step == 5:
            chunks["d"] = prompts[3]  # joins with a prefill chunk: a mixed (expanded) batch
            running.append("d")
        out = drv.step(chunks)
        for seq, logits in out.items():
            _assert_close(logits[-1], _hf_logits(hf, drv.tokens[seq])[-1])


def test_chunked_prefill_and_shared_prefix_pages(models) -> None:
    ours, hf = models("v3_yarn")
    drv = Driver(ours, seed=2)
    (prompt,) = _prompts(ours.config.vocab_size, [29], seed=3)
    pieces = [
        drv.step({"a": prompt[:8]})["a"],
        drv.step({"a": prompt[8:21]})["a"],
        drv.step({"a": prompt[21:]})["a"],
    ]
    full = torch.cat(pieces)
    _assert_close(full, _hf_logits(hf, prompt))
    # a prefix-cache hit: reuse a's first 6 pages (24 tokens) and compute only the rest
    drv.share_prefix("hit", "a", 6)
    hit = drv.step({"hit": prompt[24:]})["hit"]
    torch.testing.assert_close(hit, full[24:], rtol=0, atol=1e-5)
    # a different continuation after the shared pages writes to its own pages only
    drv.share_prefix("fork", "a", 4)
    fork_tail = _prompts(ours.config.vocab_size, [6], seed=4)[0]
    fork = drv.step({"fork": fork_tail})["fork"]
    _assert_close(fork, _hf_logits(hf, prompt[:16] + fork_tail)[16:])
    again = drv.step({"a": [5]})["a"]  # a's own pages were not disturbed by the fork
    _assert_close(again, _hf_logits(hf, prompt + [5])[-1:])


@pytest.mark.parametrize("name", ["v3_yarn", "v3_groups_dense", "v2_lite_greedy"])
def test_greedy_generation_token_identical_to_transformers(models, name: str) -> None:
    ours, hf = models(name)
    prompts = _prompts(ours.config.vocab_size, [3, 10, 6], seed=11)
    drv = Driver(ours, num_pages=64, seed=3)
    generated: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    out = drv.step({f"s{i}": p for i, p in enumerate(prompts)})
    for _ in range(40):
        for seq, logits in out.items():
            generated[seq].append(int(logits[-1].argmax()))
        out = drv.step({seq: toks[-1:] for seq, toks in generated.items()})
    hf.generation_config.eos_token_id = None  # like ignore_eos: always 40 tokens
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0)[0, len(p) :]
        assert generated[f"s{i}"] == ref.tolist()


def test_absorbed_equals_expanded_on_mixed_batch(models) -> None:
    ours, _ = models("v3_groups_dense")
    prompts = _prompts(ours.config.vocab_size, [9, 4, 17], seed=5)
    results = []
    for mode in ("expanded", "absorbed"):
        drv = Driver(ours, seed=4)
        drv.step({"a": prompts[0], "b": prompts[1]})
        results.append(drv.step({"a": [3], "b": [4], "c": prompts[2]}, attn_mode=mode))
    for seq in ("a", "b", "c"):
        torch.testing.assert_close(results[0][seq], results[1][seq], rtol=0, atol=1e-5)


def test_latent_rows_match_transformers_cache(models) -> None:
    """The pool row is [normalized c_kv, roped k_pe] exactly as transformers caches MLA (KV-transfer layout)."""
    ours, hf = models("v3_yarn")
    (prompt,) = _prompts(ours.config.vocab_size, [13], seed=6)
    drv = Driver(ours, seed=5)
    drv.step({"a": prompt})
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).cache
    table = torch.tensor(drv.tables["a"])
    for layer in range(ours.config.num_hidden_layers):
        rows = drv.kv.gather(layer, table, len(prompt))
        expected = torch.cat([cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]], dim=-1)
        torch.testing.assert_close(rows, expected, rtol=0, atol=1e-5)


def test_bfloat16_model_tracks_fp32(models, tmp_path) -> None:
    ours, _ = models("v3_yarn")
    path = make_hf_checkpoint(tmp_path, **CONFIGS["v3_yarn"])
    bf16 = load_model(path, dtype="bfloat16", progress=False)
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    assert bf16.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    (prompt,) = _prompts(ours.config.vocab_size, [16], seed=9)
    ref = Driver(ours).step({"a": prompt})["a"]
    low = Driver(bf16).step({"a": prompt})["a"]
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()


def test_forward_rejects_bad_batches(models) -> None:
    ours, _ = models("v3_yarn")
    cfg = ours.config
    kv = KVPool(cfg.num_hidden_layers, 8, 4, cfg.kv_row_dim)

    def batch(ext: list[int], seq: list[int], pages: int = 2) -> ForwardBatch:
        t = sum(ext)
        return ForwardBatch(
            torch.zeros(t, dtype=torch.long),
            torch.arange(t),
            torch.arange(t),
            ext,
            seq,
            [torch.arange(pages)] * len(ext),
        )

    with pytest.raises(ValueError, match="attn_mode"):
        ours(batch([3], [3]), kv, attn_mode="flash")
    with pytest.raises(ValueError, match="extend_len"):
        ours(batch([3], [2]), kv)
    with pytest.raises(ValueError, match="page table has 1 pages"):
        ours(batch([6], [6], pages=1), kv)
    with pytest.raises(ValueError, match="KV pool is"):
        ours(batch([3], [3]), KVPool(cfg.num_hidden_layers, 8, 4, cfg.kv_row_dim + 1))
    bad = batch([3], [3])
    bad.extend_lens = [2]
    with pytest.raises(ValueError, match="3 input ids"):
        ours(bad, kv)
