"""Block hashes: chained over whole pages, the same in any process, distinct by page size and prefix."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
