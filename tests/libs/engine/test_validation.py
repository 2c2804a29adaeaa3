"""check_prompt's C-speed path for plain int lists gives what the per-token check gives, and refuses
what it refuses (bools, out-of-vocabulary ids, other types) with the same message."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from libs.engine.sampling import SamplingParams
from libs.engine.validation import Limits, _plain_ids, check_prompt, check_token

LIMITS = Limits(vocab_size=100, context_len=4096, page_size=16, num_pages=1024)
PARAMS = SamplingParams(max_tokens=4)


def per_token(prompt: list) -> list[int] | str:
    try:
        return [check_token(t, LIMITS, "r") for t in prompt]
    except ValueError as e:
        return str(e)


def checked(prompt: list) -> list[int] | str:
    try:
        return check_prompt(prompt, PARAMS, LIMITS, "r")
    except ValueError as e:
        return str(e)


tokens = st.one_of(st.integers(-3, 103), st.booleans(), st.floats(0, 5), st.just(None))


@given(st.lists(st.integers(0, 99), min_size=1, max_size=64) | st.lists(tokens, min_size=1, max_size=8))
def test_same_ids_and_errors_as_the_per_token_check(prompt):
    assert checked(prompt) == per_token(prompt)


def test_fast_path_takes_plain_lists_only():
    assert _plain_ids([3, 0, 99], 100) == [3, 0, 99]
    for refused in ([3, True], [3, 100], [-1, 3], (3, 4), [3.0], [torch.tensor(3)]):
        assert _plain_ids(refused, 100) is None
    ids = [5, 6]
    assert check_prompt(ids, PARAMS, LIMITS, "r") == ids and check_prompt(ids, PARAMS, LIMITS, "r") is not ids
    assert check_prompt([torch.tensor(7), 8], PARAMS, LIMITS, "r") == [7, 8]  # the slow path still serves
    with pytest.raises(ValueError, match="True"):
        check_prompt([1, True], PARAMS, LIMITS, "r")
