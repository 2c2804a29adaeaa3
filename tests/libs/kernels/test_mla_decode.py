"""MLA decode kernel vs the torch oracle: ragged lengths, shuffled pages, splits, fp8 cache."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.kernels.mla_decode import MLAConfig, choose_num_splits, mla_decode, mla_decode_reference  # noqa: E402

from .conftest import HAS_CUDA  # noqa: E402

# The interpreter's bf16 dot is wrong (see conftest), so CPU runs use float16; the GPU runs use bf16.
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16
SMALL = MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)


def _case(device, batch, heads, page_size, lens, kv_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens)
    num_pages = batch * max_pages + 3
    kv = torch.randn(num_pages * page_size, 576, generator=g)
    kv = (kv / 4).to(kv_dtype) if kv_dtype is not None else kv.to(DTYPE)
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages).int()
    q = torch.randn(batch, heads, 576, generator=g).to(DTYPE)
    seq = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), kv.to(device), table.to(device), seq.to(device)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_reference_over_ragged_paged_sequences(device, num_splits):
    q, kv, table, seq = _case(device, 3, 16, 16, [1, 37, 70])
    out = torch.full((3, 16, 512), float("nan"), dtype=DTYPE, device=device)
    mla_decode(q, kv, table, seq, 16, 0.07, num_splits=num_splits, cfg=SMALL, out=out)
    ref = mla_decode_reference(q, kv, table, seq, 16, 0.07)
    assert not out.isnan().any()
    assert _rel(out, ref) < 1e-2


def test_more_splits_than_tiles_leaves_no_gap(device):
    # 8 splits of a 20-token sequence: most splits are empty and must not poison the combine.
    q, kv, table, seq = _case(device, 2, 16, 8, [20, 5], seed=1)
    out = mla_decode(q, kv, table, seq, 8, 0.1, num_splits=8, cfg=SMALL)
    assert _rel(out, mla_decode_reference(q, kv, table, seq, 8, 0.1)) < 1e-2


def test_fp8_cache_with_scale(device):
    q, kv, table, seq = _case(device, 2, 16, 16, [33, 48], kv_dtype=torch.float8_e4m3fn, seed=2)
    out = mla_decode(q, kv, table, seq, 16, 0.1, num_splits=2, kv_scale=4.0, cfg=SMALL)
    ref = mla_decode_reference(q, kv, table, seq, 16, 0.1, kv_scale=4.0)
    assert _rel(out, ref) < 1e-2


def test_rejects_bad_shapes(device):
    q, kv, table, seq = _case(device, 2, 16, 16, [3, 4])
    with pytest.raises(ValueError, match="576"):
        mla_decode(q[..., :512], kv, table, seq, 16, 0.1, cfg=SMALL)
    with pytest.raises(ValueError, match="page_table"):
        mla_decode(q, kv, table[:1], seq, 16, 0.1, cfg=SMALL)


def test_split_choice_fills_the_machine_and_respects_short_contexts():
    cfg = MLAConfig()
    assert choose_num_splits(256, 128, 8192, cfg) == 1
    assert choose_num_splits(32, 128, 8192, cfg) >= 4
    assert choose_num_splits(32, 128, 64, cfg) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_dtype", [(128, None), (16, None), (128, torch.float8_e4m3fn)])
def test_real_shapes_on_gpu(heads, kv_dtype):
    lens = [2048, 1, 3000, 517, 64, 2100, 1999, 8]
    q, kv, table, seq = _case("cuda", len(lens), heads, 64, lens, kv_dtype=kv_dtype, seed=3)
    scale = 4.0 if kv_dtype is not None else 1.0
    ref = mla_decode_reference(q, kv, table, seq, 64, 0.1352, kv_scale=scale)
    for splits in (1, 4):
        out = mla_decode(q, kv, table, seq, 64, 0.1352, num_splits=splits, kv_scale=scale)
        assert _rel(out, ref) < 1e-2


def test_split_query_parts_with_transposed_strides(device):
    q, kv, table, seq = _case(device, 3, 16, 16, [9, 40, 17], seed=4)
    q_lat = q[..., :512].transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, 512] with head-major storage
    q_rope = q[..., 512:].contiguous()
    out = mla_decode(q_lat, kv, table, seq, 16, 0.1, num_splits=2, cfg=SMALL, q_rope=q_rope)
    assert _rel(out, mla_decode_reference(q, kv, table, seq, 16, 0.1)) < 1e-2


def test_slot_table_as_page_size_one(device):
    # The engine hook passes each key's pool slot as a page table with page size 1.
    q, kv, table, seq = _case(device, 2, 16, 8, [13, 30], seed=5)
    slots = (table.long()[:, :, None] * 8 + torch.arange(8, device=device)).view(2, -1)
    out = mla_decode(q, kv, slots.int(), seq, 1, 0.1, num_splits=2, cfg=SMALL)
    assert _rel(out, mla_decode_reference(q, kv, table, seq, 8, 0.1)) < 1e-2


@pytest.mark.parametrize("num_splits", [1, 2])
def test_a_column_major_page_table(device, num_splits):
    """The decode graphs keep the table column-major (libs/engine/cuda_graph.py: a step copies only the
    columns it reads): the kernel follows the table's strides, same output as a row-major table."""
    q, kv, table, lens = _case(device, 3, 16, 4, [9, 1, 30])
    col_major = table.t().contiguous().t()
    assert col_major.stride() == (1, table.shape[0]) and torch.equal(col_major, table)
    scale = 0.1
    ref = mla_decode(q, kv, table, lens, 4, scale, num_splits=num_splits)
    got = mla_decode(q, kv, col_major, lens, 4, scale, num_splits=num_splits)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
