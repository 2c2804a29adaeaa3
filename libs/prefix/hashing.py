"""Block hashes: one 64-bit id per full page of a token sequence, chained so that the hash of page i
stands for all tokens of pages 0..i (the whole prefix, not just that page's tokens)."""

# Every worker, the kv-broker and the scheduler compute the same hashes for the same tokens and page size,
# with nothing shared but this function: hash_i = blake2b-64(hash_{i-1} || tokens of page i), both as
# little-endian integers (8 bytes, then 4 per token), starting from `root_hash(page_size)`. The page size
# is in the root, so caches with different page sizes never claim each other's blocks. Only full pages
# are hashed, as only full pages are cached (libs.engine.radix_cache).

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_DOMAIN = b"moemesh-kv-block-v1"
_MAX_TOKEN = 0xFFFFFFFF
if array("I").itemsize != 4:
    raise ImportError("libs.prefix.hashing packs tokens as array('I'), which is not 4 bytes on this platform")
_SWAP = sys.byteorder != "little"  # the hashed bytes are little-endian on every machine


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(page_size: int) -> int:
    """The parent of a sequence's first page: depends on the page size only."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    return _digest(_DOMAIN + page_size.to_bytes(4, "little"))


def extend_hashes(parent: int, tokens: Sequence[int], page_size: int) -> list[int]:
    """Hashes of the full pages of `tokens`, chained from `parent` (the hash of the page before tokens[0], or
    root_hash(page_size) at the start of a sequence); a partial last page is ignored."""
    # Packed once (uint32, little-endian) and hashed from slices: a decode worker hashes every finished
    # sequence on its engine thread.
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    full = len(tokens) // page_size * page_size
    try:
        packed = array("I", tokens[:full])
    except (OverflowError, TypeError) as e:
        bad = next((t for t in tokens[:full] if not (isinstance(t, int) and 0 <= t <= _MAX_TOKEN)), None)
        raise ValueError(f"token ids must be integers in 0..{_MAX_TOKEN}, got {bad!r}") from e
    if _SWAP:
        packed.byteswap()
    data, step = packed.tobytes(), 4 * page_size
    # The chain runs on the 8-byte digests themselves (the little-endian bytes of each hash), converted to
    # ints once at the end: cheaper than an int round trip per page.
    blake2b, prev, digests = hashlib.blake2b, parent.to_bytes(8, "little"), []
    for start in range(0, len(data), step):
        prev = blake2b(prev + data[start : start + step], digest_size=8).digest()
        digests.append(prev)
    return [int.from_bytes(d, "little") for d in digests]


def block_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """Hashes of every full page of a sequence, from its start."""
    return extend_hashes(root_hash(page_size), tokens, page_size)
