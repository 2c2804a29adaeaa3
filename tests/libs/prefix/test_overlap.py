"""The overlap rule shared by the kv-broker's index and the scheduler's recent placements."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

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


def _leading_reference(hashes, holds) -> dict[str, int]:
    """The rule as written: each holder's run of leading blocks, one holder at a time."""
    out: dict[str, int] = {}
    for w in {w for h in hashes for w in holds.get(h, ())}:
        n = 0
        while n < len(hashes) and w in holds.get(hashes[n], ()):
            n += 1
        if n:
            out[w] = n
    return out


@given(
    st.lists(st.integers(0, 7), max_size=12),
    st.dictionaries(st.integers(0, 7), st.sets(st.sampled_from("abcde")), max_size=8),
    st.booleans(),
)
def test_leading_matches_the_rule_per_holder(hashes, holds, as_dicts) -> None:
    if as_dicts:  # RecentPlacements keeps holder -> expiry
        holds = {h: dict.fromkeys(ws, 1.0) for h, ws in holds.items()}
    assert leading(hashes, holds) == _leading_reference(hashes, holds)
