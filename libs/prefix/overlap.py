"""Prefix overlap: for a prompt's block hashes (in order), each holder's run of leading blocks. Radix
caches evict leaves first, so a holder of block i almost always holds 0..i-1 too."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def leading(hashes: Sequence[int], holds: Mapping[int, Iterable[str]]) -> dict[str, int]:
    """Holder -> how many of `hashes`, from the first, it holds (holders of none left out). `holds`
    maps a block hash to its holders (a set, or a dict keyed by holder)."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(hashes):
        owners = set(holds.get(h, ()))
        still = owners if alive is None else alive & owners
        for w in (alive or set()) - still:
            out[w] = i
        alive = still
        if not alive:
            return out
    out.update((w, len(hashes)) for w in alive or ())
    return out
