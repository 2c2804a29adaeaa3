"""Block hashes: chained over whole pages, the same in any process, distinct by page size and prefix."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.prefix import block_hashes, extend_hashes, root_hash

TOKENS = [(7 * i + 3) % 1000 for i in range(50)]


def test_one_hash_per_full_page_and_chained() -> None:
    hs = block_hashes(TOKENS, 16)
    assert len(hs) == 3  # 50 tokens: 3 full pages, the partial fourth is not a block
    assert hs == block_hashes(TOKENS[:48], 16) == block_hashes(TOKENS[:49], 16)
    assert extend_hashes(hs[0], TOKENS[16:48], 16) == hs[1:]  # resuming from a parent gives the same chain
    assert len(set(hs)) == 3 and all(0 <= h < 2**64 for h in hs)


def test_a_page_hash_covers_its_whole_prefix() -> None:
    other = [1] + TOKENS[1:]  # same pages 1 and 2, different first token
    a, b = block_hashes(TOKENS, 16), block_hashes(other, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_page_size_is_part_of_the_identity() -> None:
    assert root_hash(8) != root_hash(16)
    assert set(block_hashes(TOKENS, 8)).isdisjoint(block_hashes(TOKENS, 16))


def test_same_tokens_same_hashes_in_another_process() -> None:
    """Two workers are two processes: nothing like Python's per-process hash seed may leak in."""
    code = f"from libs.prefix import block_hashes; print(block_hashes({TOKENS!r}, 16))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=".",
    )  # fmt: skip
    assert out.stdout.strip() == str(block_hashes(TOKENS, 16))


@pytest.mark.parametrize("bad", [[-1] * 4, [2**32] * 4, [1.5] * 4, ["a"] * 4])
def test_bad_tokens_are_a_clear_error(bad) -> None:
    with pytest.raises(ValueError, match="token ids must be integers"):
        block_hashes(bad, 4)


def test_bad_page_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="page_size"):
        block_hashes(TOKENS, 0)


# Golden values: workers, the kv-broker and the scheduler of different versions meet in one mesh and
# must agree on every block hash, so a change to the hash (domain, byte order, chaining, width) has to
# break this test and be shipped as a deliberate, versioned change (a new domain string).
GOLDEN_ROOTS = {1: 0xE96B0D2EC4CBE0B3, 16: 0x99D17C6FAEF99630}
GOLDEN = [
    (list(range(40)), 16, [0x5C93EB6CAA4BDFE1, 0x1A63FA16C192D6F6]),
    ([0, 1, 2**32 - 1, 5], 2, [0x891EF62F785B6D56, 0x0888669B32CDAE90]),
]


def test_golden_block_hashes() -> None:
    assert {p: root_hash(p) for p in GOLDEN_ROOTS} == GOLDEN_ROOTS
    for tokens, page_size, want in GOLDEN:
        assert block_hashes(tokens, page_size) == want


def test_golden_values_follow_the_documented_formula() -> None:
    """hash_i = blake2b-64(hash_{i-1} || page i's tokens), little-endian (8 bytes, then 4 per token),
    from blake2b-64(b"moemesh-kv-block-v1" || page_size as 4 bytes); digests read little-endian."""
    import hashlib

    def b2(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def root(page_size: int) -> int:
        return b2(b"moemesh-kv-block-v1" + page_size.to_bytes(4, "little"))

    assert {p: root(p) for p in GOLDEN_ROOTS} == GOLDEN_ROOTS
    for tokens, page_size, want in GOLDEN:
        h, got = root(page_size), []
        for start in range(0, len(tokens) // page_size * page_size, page_size):
            page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
            h = b2(h.to_bytes(8, "little") + page)
            got.append(h)
        assert got == want


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40))
def test_hashes_follow_the_documented_definition(tokens: list[int], page_size: int) -> None:
    """hash_i = blake2b-64(hash_{i-1} || tokens of page i), little-endian (8 bytes, then 4 per token), from
    blake2b-64("moemesh-kv-block-v1" || page_size as 4 bytes): every service must agree on it, so any change
    to the code that computes it must keep it."""

    def b2(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    h = b2(b"moemesh-kv-block-v1" + page_size.to_bytes(4, "little"))
    expected = []
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        h = b2(h.to_bytes(8, "little") + page)
        expected.append(h)
    assert block_hashes(tokens, page_size) == expected
