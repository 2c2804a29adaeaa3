import math

import pytest
import torch

from libs.engine.sampling import SamplingParams, make_generator, sample


def _gens(n, seed=None):
    return [make_generator(None if seed is None else seed + i) for i in range(n)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_are_frozen_and_normalized():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], logprobs=True, top_logprobs=2)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert p.wants_logprobs and p.num_top_logprobs == 2
    assert SamplingParams(logprobs=5).num_top_logprobs == 5
    assert not SamplingParams(logprobs=0).wants_logprobs
    hash(p)
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # type: ignore[misc]


def test_greedy_and_top_k_1_take_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=2.0)] * 2
    out = sample(logits, params, _gens(4))
    assert out.token_ids == logits.argmax(1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        gen = make_generator(7)
        runs.append([sample(logits[:1], [p], [gen]).token_ids[0] for _ in range(20)])
    assert runs[0] == runs[1]
    # the same generator stream in a bigger batch draws the same tokens for that row
    gen = make_generator(7)
    mixed = []
    for _ in range(20):
        out = sample(logits, [p, SamplingParams(), SamplingParams(temperature=0)], [gen, *_gens(2)])
        mixed.append(out.token_ids[0])
    assert mixed == runs[0]
    other = make_generator(8)
    assert [sample(logits[:1], [p], [other]).token_ids[0] for _ in range(20)] != runs[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-30).log().unsqueeze(0).repeat(4000, 1)
    out = sample(logits, [SamplingParams()] * 4000, _gens(4000, seed=0))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def _support(logits, params, n=600):
    out = sample(logits.repeat(n, 1), [params] * n, _gens(n, seed=100))
    return set(out.token_ids)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0]])
    assert _support(logits, SamplingParams(top_k=2)) == {0, 1}
    probs = logits.softmax(1)[0]  # ~ .49 .30 .18 .07 .02 .01
    assert probs[:2].sum() < 0.85 < probs[:3].sum()
    assert _support(logits, SamplingParams(top_p=0.85)) == {0, 1, 2}
    assert _support(logits, SamplingParams(top_p=0.01)) == {0}
    # min_p 0.3: keep tokens with p >= 0.3 * p_max (0.49 * 0.3 = 0.147)
    assert _support(logits, SamplingParams(min_p=0.3)) == {0, 1, 2}
    assert _support(logits, SamplingParams()) == set(range(6))


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    n = 2000
    cold = sample(logits.repeat(n, 1), [SamplingParams(temperature=0.25)] * n, _gens(n, 0)).token_ids
    hot = sample(logits.repeat(n, 1), [SamplingParams(temperature=4.0)] * n, _gens(n, 0)).token_ids
    p_cold = 1 / (1 + math.exp(-4))
    p_hot = 1 / (1 + math.exp(-0.25))
    assert abs(cold.count(0) / n - p_cold) < 0.03
    assert abs(hot.count(0) / n - p_hot) < 0.04


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=4),
        SamplingParams(temperature=0.7, logprobs=2, seed=1),
        SamplingParams(temperature=0),
    ]
    out = sample(logits, params, _gens(3, 0))
    ref = logits.log_softmax(1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-6)
        vals, ids = ref[i].topk(params[i].num_top_logprobs)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.logprobs[2] is None


def test_sample_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="len\\(params\\)"):
        sample(torch.zeros(2, 5), [SamplingParams()], _gens(1))
