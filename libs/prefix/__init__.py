"""Prefix-block identity shared by workers, the kv-broker and the scheduler, and the overlap rule both
the kv-broker and the scheduler apply to it (pure, no torch)."""

from libs.prefix.hashing import block_hashes, extend_hashes, root_hash
from libs.prefix.overlap import leading, tier_weighted

__all__ = ["block_hashes", "extend_hashes", "leading", "root_hash", "tier_weighted"]
