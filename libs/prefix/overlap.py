"""Prefix overlap: for a prompt's block hashes (in order), each holder's run of leading blocks. Radix
caches evict leaves first, so a holder of block i almost always holds 0..i-1 too."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def leading(hashes: Sequence[int], holds: Mapping[int, Iterable[str]]) -> dict[str, int]:
    """Holder -> how many of `hashes`, from the first, it holds (holders of none left out). `holds` maps a
    block hash to its holders (a set, or a dict keyed by holder)."""
    # One set intersection per block; holders that drop out are looked at only when some do, so a prefix
    # every worker holds costs no per-holder work until the prompts diverge.
    out: dict[str, int] = {}
    if not hashes or not (first := holds.get(hashes[0])):
        return out
    alive = set(first)
    for i in range(1, len(hashes)):
        owners = holds.get(hashes[i])
        still = alive.intersection(owners) if owners else set()
        if len(still) < len(alive):  # a subset: fewer means some holders' runs end at block i
            out.update(dict.fromkeys(alive.difference(still), i))
            if not still:
                return out
            alive = still
    out.update(dict.fromkeys(alive, len(hashes)))
    return out


def tier_weighted(
    blocks: tuple[int, int, int], page_size: int, host_weight: float, store_weight: float
) -> int:
    """A (device, host, store) blocks hit as the device tokens it is worth: a host block counts
    host_weight of one (a copy to the device), a store block store_weight (a fetch, then that copy);
    weights in (0, 1], so a hit on any tier still beats recomputing and a nearer tier a farther one."""
    device, host, store = blocks
    return round((device + host_weight * host + store_weight * store) * page_size)
