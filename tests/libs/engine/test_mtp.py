"""MTP speculative decoding (libs/engine/speculative.py, models/mtp.py): greedy output identical to the
plain engine on random tiny configs (drafts mostly rejected) and on a briefly trained demo model (drafts
often accepted), through chunked prefill, the prefix cache, preemption, stops and the PD hooks, with no
leaked page; rejection sampling keeps the target distribution; MTP weights load in BF16/FP32 and FP8."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from libs.demo.train import build_demo_model, quick_settings
from libs.engine import Engine, SamplingParams
from libs.engine.speculative import Draft, MTPEngine, accept_drafts
from libs.engine.tiny import write_tiny_model
from libs.worker.settings import WorkerSettings

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 40, 41], list(range(100, 137)), [300]]


def assert_no_leak(engine: Engine) -> None:
    engine.flush_prefix_cache()
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"], stats
    assert not engine.requests and not engine.reservations


def generate_both(path, prompts, params, k, **kw):
    base = Engine.from_pretrained(path, page_size=4, **kw)
    spec = MTPEngine.load(path, mtp_k=k, page_size=4, **kw)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    got = [o.token_ids for o in spec.generate(prompts, params)]
    return ref, got, spec


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A demo-recipe checkpoint trained for a few seconds: its MTP module agrees with the target often."""
    out = tmp_path_factory.mktemp("demo")
    build_demo_model(out, quick_settings(steps=60, batch_size=4, seq_len=64), log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def demo_prompts(demo):
    tok = Engine.from_pretrained(demo).tokenizer
    texts = ["A list is", "The import statement", "Dictionaries", "class"]
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": None}, {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}],
    ids=["v3", "no-q-lora", "all-moe"],
)
def test_greedy_identical_on_tiny_configs(tmp_path, overrides):
    path = write_tiny_model(tmp_path, seed=3, num_nextn_predict_layers=1, **overrides)
    ref, got, spec = generate_both(path, PROMPTS, GREEDY, k=2, max_prefill_tokens=16)
    assert got == ref
    assert spec.num_drafted > 0
    assert_no_leak(spec)


def test_greedy_identical_on_the_transformers_written_config(tmp_path):
    """The suite's hidden-style config (hf_utils.TINY_V3, saved by transformers), plus a random MTP
    layer in a shard of its own, as a checkpoint with the nextn module would have it."""
    import json

    from safetensors.torch import save_file

    from libs.engine.tiny import random_weights
    from tests.libs.engine.hf_utils import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path, seed=2)
    config = json.loads((path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    prefix = f"model.layers.{config['num_hidden_layers']}."
    weights = random_weights(config | {"topk_method": "noaux_tc"}, seed=5)
    save_file({k: v for k, v in weights.items() if k.startswith(prefix)}, str(path / "mtp.safetensors"))
    ref, got, spec = generate_both(path, PROMPTS, GREEDY, k=2, max_prefill_tokens=16)
    assert got == ref and spec.num_drafted > 0
    assert_no_leak(spec)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_on_trained_model_with_accepted_drafts(demo, demo_prompts, k):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 5, 17, 2)]
    ref, got, spec = generate_both(demo, demo_prompts, params, k=k)
    assert got == ref
    assert spec.num_accepted > 0, "the trained MTP module should have some drafts accepted"
    assert all(len(t) == p.max_tokens for t, p in zip(got, params, strict=True))
    assert_no_leak(spec)


def test_stops_inside_an_accepted_run_and_logprobs(demo, demo_prompts):
    base = Engine.from_pretrained(demo)
    (full,) = base.generate([demo_prompts[0]], GREEDY)
    stop_id = full.token_ids[6]
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_id,), logprobs=2)
    (ref,) = base.generate([demo_prompts[0]], params)
    spec = MTPEngine.load(demo, mtp_k=3)
    (got,) = spec.generate([demo_prompts[0]], params)
    assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "stop"
    assert ref.logprobs is not None and got.logprobs is not None
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert_no_leak(spec)


def test_prefix_cache_chunked_prefill_and_preemption(demo, demo_prompts):
    shared = demo_prompts[0] * 6
    prompts = [shared + p for p in demo_prompts] * 2
    # 24 pages of 4 tokens cannot hold 8 growing requests at once: the newest are preempted and resumed
    ref, got, spec = generate_both(demo, prompts, GREEDY, k=2, num_pages=24, max_prefill_tokens=8)
    assert got == ref
    assert spec.num_preemptions > 0
    assert_no_leak(spec)


def test_pd_decode_side_drafts(demo, demo_prompts):
    """Prefill on a plain engine, copy its KV into pages reserved on an MTP engine, decode there."""
    prefill_side = Engine.from_pretrained(demo, page_size=4, num_pages=64)
    decode_side = MTPEngine.load(demo, mtp_k=2, page_size=4, num_pages=64)
    ref = [o.token_ids for o in Engine.from_pretrained(demo).generate(demo_prompts, GREEDY)]
    src = prefill_side.kv_pool.buffer.view(prefill_side.kv_pool.num_layers, 64, 4, -1)
    dst = decode_side.kv_pool.buffer.view(decode_side.kv_pool.num_layers, 64, 4, -1)
    tokens = {}
    for i, prompt in enumerate(demo_prompts):
        res = prefill_side.prefill(f"r{i}", prompt, GREEDY)
        pages = decode_side.reserve(f"r{i}", len(prompt))
        dst[:, pages] = src[:, res.page_ids]
        prefill_side.release(f"r{i}")
        decode_side.add_prefilled(f"r{i}", prompt, res.first_token, GREEDY)
        tokens[f"r{i}"] = [res.first_token]
    while decode_side.has_unfinished():
        for out in decode_side.step():
            tokens[out.rid] += out.token_ids
    assert [tokens[f"r{i}"] for i in range(len(demo_prompts))] == ref
    assert decode_side.num_drafted > 0
    assert_no_leak(decode_side)


def _first_token_histogram(p_logits, q, params, draws, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p_logits.shape[1])
    for _ in range(draws):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        out = accept_drafts(p_logits, Draft([d], q), params, gen)
        counts[out[0]] += 1
    return counts / draws


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)]
)
def test_rejection_sampling_keeps_the_target_distribution(params):
    """The first emitted token is a draft from q accepted with min(1, p/q) or a residual draw; its
    distribution must be the target's p (whatever q is), within sampling error of 20k draws."""
    from libs.engine.sampling import sampling_probs

    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0] * 6])
    q = torch.tensor([[0.05, 0.05, 0.5, 0.1, 0.2, 0.1]])  # far from p on purpose
    p = sampling_probs(p_logits[:1], [params])[0]
    freq = _first_token_histogram(p_logits, q, params, draws=20000, seed=0)
    assert (freq - p).abs().sum() / 2 < 0.02, (freq, p)  # total variation; a broken rule gives > 0.2
    # the plain draft distribution is far from p, so the test can tell them apart
    assert (q[0] - p).abs().sum() / 2 > 0.3


def test_sampled_requests_run_and_stay_in_vocabulary(demo, demo_prompts):
    spec = MTPEngine.load(demo, mtp_k=2)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)
    outs = spec.generate(demo_prompts, params)
    assert all(len(o.token_ids) == 16 for o in outs)
    assert all(0 <= t < spec.config.vocab_size for o in outs for t in o.token_ids)
    assert spec.num_accepted > 0
    assert_no_leak(spec)


def test_fp8_checkpoint_mtp_weights(tmp_path):
    path = write_tiny_model(tmp_path, seed=4, fp8=True, num_nextn_predict_layers=1, hidden_size=256)
    kept = MTPEngine.load(path, mtp_k=1, quantization="fp8")
    assert kept.mtp.eh_proj.is_fp8
    dense = MTPEngine.load(path, mtp_k=1, quantization="none")
    x = torch.randn(3, 512)
    a, b = kept.mtp.eh_proj(x), dense.mtp.eh_proj(x)  # FP8 GEMM (activations quantized too) vs dequantized
    assert (a - b).norm() / b.norm() < 0.05
    ref = [
        o.token_ids for o in Engine.from_pretrained(path, quantization="none").generate(PROMPTS[:2], GREEDY)
    ]
    assert [o.token_ids for o in dense.generate(PROMPTS[:2], GREEDY)] == ref


def test_clear_errors(tmp_path):
    path = write_tiny_model(tmp_path, seed=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        MTPEngine.load(path)
    with pytest.raises(ValueError, match="mtp_k >= 1"):
        MTPEngine(Engine.from_pretrained(path).model, None, mtp_k=0)  # type: ignore[arg-type]
    assert WorkerSettings(model_dir=str(path), mtp_k=2, ep_size=2).mtp_k == 2  # EP ranks draft too


def test_engine_sampled_tokens_keep_the_target_distribution(demo, demo_prompts):
    """Through the engine: token 2 of each request is either an accepted MTP draft or a residual draw;
    the joint distribution of (token 1, token 2) over 400 seeded requests must match the target's exact
    one (from prefill logits) within sampling error."""
    from libs.engine.sampling import sampling_probs

    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    prompt = demo_prompts[0]
    spec = MTPEngine.load(demo, mtp_k=1, max_num_seqs=64)
    n = 400
    outs = spec.generate([prompt] * n, [dataclasses.replace(params, seed=i) for i in range(n)])
    assert spec.num_drafted >= n and 0 < spec.num_accepted < spec.num_drafted
    base = Engine.from_pretrained(demo)
    p1 = sampling_probs(base.prefill_logits(prompt)[-1:], [params])[0]
    exact: dict[tuple[int, int], float] = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = sampling_probs(base.prefill_logits(prompt + [t1])[-1:], [params])[0]
        for t2 in p2.nonzero().flatten().tolist():
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = (o.token_ids[0], o.token_ids[1])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    tv = sum(abs(counts.get(k, 0) / n - v) for k, v in exact.items()) / 2
    assert tv < 0.12, tv  # 9 cells, 400 draws: ~0.05 expected from noise alone
