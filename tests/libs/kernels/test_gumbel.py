"""The one-pass Gumbel-max sampler: greedy equals argmax, draws follow softmax(logits / T), noise is keyed
by (seed, position) only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels.gumbel import gumbel_sample  # noqa: E402


def _inputs(b, device, temp, seed0=0, pos=7):
    return (
        torch.full((b,), temp, device=device),
        torch.arange(seed0, seed0 + b, device=device),
        torch.full((b,), pos, dtype=torch.int32, device=device),
    )


def test_temperature_zero_is_argmax_with_ties_to_the_lowest_id(device):
    logits = torch.randn(6, 5000).to(torch.bfloat16)
    logits[2, 10] = logits[2, 4200] = 50.0  # a tie across two blocks of the kernel's loop
    logits[3, 7] = logits[3, 9] = 50.0  # a tie inside one block
    got = gumbel_sample(logits.to(device), *_inputs(6, device, 0.0))
    assert got.cpu().tolist() == logits.float().argmax(-1).tolist()
    assert got[2] == 10 and got[3] == 7


def test_draws_follow_the_tempered_softmax(device):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2], device=device)
    b, temp = 400, 0.5  # the interpreter runs ~8 ms per row; the draws are keyed, so the test is deterministic
    tokens = gumbel_sample(logits.expand(b, -1).contiguous(), *_inputs(b, device, temp)).cpu()
    freq = torch.bincount(tokens, minlength=8).float() / b
    p = torch.softmax(logits.cpu() / temp, -1)
    sigma = (p * (1 - p) / b).sqrt()
    assert ((freq - p).abs() <= 4 * sigma + 1e-3).all(), (freq, p)
    untempered = torch.softmax(logits.cpu(), -1)  # what ignoring the temperature would give
    assert (freq - p).abs().sum() < (freq - untempered).abs().sum() / 2


def test_noise_is_keyed_by_seed_and_position(device):
    logits = torch.zeros(64, 1000, device=device)  # uniform: the noise alone picks
    a = gumbel_sample(logits, *_inputs(64, device, 1.0))
    assert torch.equal(a, gumbel_sample(logits, *_inputs(64, device, 1.0)))  # same keys, same draws
    assert len(set(a.tolist())) > 40  # distinct seeds draw independently
    moved = gumbel_sample(logits, *_inputs(64, device, 1.0, pos=8))  # the next decode position
    assert (moved != a).float().mean() > 0.9
    # a row's draw does not depend on which rows share its batch
    alone = gumbel_sample(logits[5:6], *[t[5:6] for t in _inputs(64, device, 1.0)])
    assert alone.item() == a[5].item()


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_logprobs_of_the_chosen_tokens_in_the_same_pass(device, temp):
    logits = (torch.randn(5, 5000) * 3).to(torch.bfloat16)
    logits[1, 4999] = 40.0  # the best in the last, partial block
    logits[2, :4096] = float("-inf")  # a whole block of the kernel's loop masked out
    lp = torch.empty(5, dtype=torch.float32, device=device)
    ids = gumbel_sample(logits.to(device), *_inputs(5, device, temp), logprobs=lp)
    plain = gumbel_sample(logits.to(device), *_inputs(5, device, temp))
    assert torch.equal(ids, plain), "asking for logprobs does not change the draws"
    want = logits.float().log_softmax(-1).gather(1, ids.cpu()[:, None])[:, 0]
    torch.testing.assert_close(lp.cpu(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="logprobs must be"):
        gumbel_sample(logits.to(device), *_inputs(5, device, temp), logprobs=lp[:4])


def test_rejects_mismatched_shapes(device):
    with pytest.raises(ValueError, match=r"must each be \[4\]"):
        gumbel_sample(torch.zeros(4, 10, device=device), *_inputs(3, device, 1.0))
