"""Prefix-block identity shared by workers, the kv-broker and the scheduler (pure, no torch)."""

from libs.prefix.hashing import block_hashes, extend_hashes, root_hash

__all__ = ["block_hashes", "extend_hashes", "root_hash"]
