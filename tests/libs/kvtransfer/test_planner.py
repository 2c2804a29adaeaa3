import random

import pytest
import torch

from libs.engine.kv_pool import KVPool
from libs.kvtransfer import InProcessTransport, PageGeometry, merge_page_pairs, plan_page_runs


def geom(base=0x1000, pages=16, page_bytes=64, layers=3, stride=None):
    return PageGeometry(
        base_addr=base, layer_stride=stride or pages * page_bytes, page_bytes=page_bytes, num_layers=layers,
        num_pages=pages,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("src", "dst", "spans"),
    [
        ([], [], []),
        ([3], [7], [(3, 7, 1)]),
        ([0, 1, 2, 3], [4, 5, 6, 7], [(0, 4, 4)]),
        ([0, 1, 2, 3], [4, 5, 9, 10], [(0, 4, 2), (2, 9, 2)]),  # destination breaks
        ([0, 1, 5, 6], [4, 5, 6, 7], [(0, 4, 2), (5, 6, 2)]),  # source breaks
        ([2, 1, 0], [2, 1, 0], [(2, 2, 1), (1, 1, 1), (0, 0, 1)]),  # descending never merges
        ([0, 1, 1, 2], [0, 1, 1, 2], [(0, 0, 2), (1, 1, 2)]),
    ],
)
def test_merge_page_pairs(src, dst, spans):
    assert merge_page_pairs(src, dst) == spans


def test_runs_are_per_layer_with_each_sides_own_addresses():
    src, dst = geom(base=0x10000, pages=16), geom(base=0x90000, pages=32)
    runs = plan_page_runs(3, [4, 5, 6, 9], [0, 1, 2, 30], src, dst)
    expected = []
    for layer in range(3):
        s0, d0 = 0x10000 + layer * 16 * 64, 0x90000 + layer * 32 * 64
        expected += [(s0 + 4 * 64, d0, 3 * 64), (s0 + 9 * 64, d0 + 30 * 64, 64)]
    assert runs == expected


def test_fewer_layers_than_the_pool():
    assert len(plan_page_runs(1, [0, 1], [0, 1], geom(), geom())) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dst": geom(page_bytes=128)}, "page_bytes 64 .source. != 128"),
        ({"dst": geom(layers=4)}, "num_layers 3 .source. != 4"),
        ({"num_layers": 4}, "num_layers must be in 1..3"),
        ({"num_layers": 0}, "num_layers must be in 1..3"),
        ({"src_pages": [0, 1], "dst_pages": [0]}, "2 source pages but 1 destination"),
        ({"src_pages": [16], "dst_pages": [0]}, "source page 16 out of range"),
        ({"src_pages": [0], "dst_pages": [-1]}, "destination page -1 out of range"),
    ],
)
def test_bad_plans_are_clear_errors(kwargs, match):
    args = {"num_layers": 3, "src_pages": [0], "dst_pages": [0], "src": geom(), "dst": geom()} | kwargs
    with pytest.raises(ValueError, match=match):
        plan_page_runs(args["num_layers"], args["src_pages"], args["dst_pages"], args["src"], args["dst"])


def test_planned_runs_copy_exactly_the_pages_between_real_pools():
    rng = random.Random(0)
    src_pool = KVPool(num_layers=3, num_pages=20, page_size=4, row_dim=8)
    dst_pool = KVPool(num_layers=3, num_pages=24, page_size=4, row_dim=8)
    src_pool.buffer.copy_(torch.randn_like(src_pool.buffer))
    src_pages = rng.sample(range(20), 6) + [10, 11, 12]
    dst_pages = rng.sample(range(12), 6) + [20, 21, 22]
    a, b = InProcessTransport(), InProcessTransport()
    try:
        a.register(src_pool.data_ptr(), src_pool.nbytes)
        b.register(dst_pool.data_ptr(), dst_pool.nbytes)
        runs = plan_page_runs(
            3, src_pages, dst_pages, PageGeometry.of_pool(src_pool), PageGeometry.of_pool(dst_pool)
        )
        assert a.write(b.session_id, runs) == 3 * len(src_pages) * src_pool.bytes_per_page
    finally:
        a.close()
        b.close()
    expected = torch.zeros_like(dst_pool.buffer).view(3, 24, 4, 8)
    expected[:, dst_pages] = src_pool.buffer.view(3, 20, 4, 8)[:, src_pages]
    assert torch.equal(dst_pool.buffer.view(3, 24, 4, 8), expected)
