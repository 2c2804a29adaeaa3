"""bench.load_layout's scaling: the 671B checkpoint's bytes from the release's shapes, and the arithmetic
from a measured layout load to one rank alone and a box of eight."""

from __future__ import annotations

from bench.load_layout import full_size_bytes, scaled


def test_full_size_bytes_are_the_releases() -> None:
    full = full_size_bytes(8)
    assert full["checkpoint"] == 688_574_839_360  # DeepSeek-V3's 163 shards: 641.29 GiB of tensors
    assert full["all_experts"] == 8 * full["experts"] and full["experts"] > full["shared"]
    assert full["shared"] + full["all_experts"] < full["checkpoint"]  # the MTP layer is not a rank's


def test_scaled_adds_the_missing_bytes_at_the_read_rate() -> None:
    full = {"shared": 10_000, "experts": 4_000, "all_experts": 128_000, "checkpoint": 150_000}
    got = scaled(2.0, 1_000, full, 1_000.0, 32)
    assert got["rank_bytes"] == 14_000 and got["rank_s"] == 2.0 + 13.0
    assert got["box_bytes"] == 10_000 + 8 * 4_000 and got["box_s"] == 42.0
    assert scaled(99.0, 1_000, full, 1_000.0, 4)["box_s"] == 99.0  # per-tensor work bounds a fast disk
