"""The overlap rule shared by the kv-broker's index and the scheduler's recent placements."""

from __future__ import annotations

from libs.prefix import leading


def test_leading_counts_each_holders_run_from_the_first_block() -> None:
    holds = {1: {"a", "b"}, 2: {"a", "b"}, 3: {"a"}, 5: {"a", "b"}}
    assert leading([1, 2, 3, 4, 5], holds) == {"a": 3, "b": 2}
    assert leading([1, 2], holds) == {"a": 2, "b": 2}
    assert leading([5, 1], holds) == {"a": 2, "b": 2}
    assert leading([4, 1], holds) == {} and leading([], holds) == {}


def test_leading_takes_holders_as_dict_keys_too() -> None:
    holds = {1: {"a": 9.0, "b": 9.0}, 2: {"b": 9.0}}
    assert leading([1, 2], holds) == {"a": 1, "b": 2}
