"""FlashInferMLA.plan_host's page indices from the host's page table (no FlashInfer needed: the wrapper it
plans is replaced by a recorder): each row's pages in order, whatever the table's layout and width."""

from __future__ import annotations

import numpy as np

from libs.engine.cuda_graph import DecodeLayout, fill_decode_inputs
from libs.kernels.flashinfer_mla import FlashInferMLA


class _Recorder:
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_lens, *args) -> None:
        self.kv_indptr, self.kv_indices = kv_indptr.tolist(), kv_indices.tolist()
        self.kv_lens = kv_lens.tolist()


def test_indices_are_each_rows_pages_from_a_column_major_graph_table() -> None:
    """A decode graph's staging table (column-major, 40 columns wide, stale ids past each row's pages from
    an earlier, longer batch): only each row's own pages are planned, in row order."""
    layout, page, scratch = DecodeLayout(batch=4, max_pages=40), 4, 999
    buf = np.zeros(layout.size, dtype=np.int32)
    fill_decode_inputs(buf, layout, [1] * 4, [150, 150, 150, 150], [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)], page, scratch)  # fmt: skip
    tables = [[7, 8, 9], [3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    positions = [9, 0, 37]  # 3, 1 and 10 pages
    fill_decode_inputs(buf, layout, [5, 6, 7], positions, tables, page, scratch)
    _, _, _, lens, table = layout.views(buf)
    mla = FlashInferMLA.__new__(FlashInferMLA)
    mla._wrapper = _Recorder()
    mla.plan_host(lens, table, page, 16, 0.1)
    got = mla._wrapper
    assert got.kv_lens == [10, 1, 38, 1]
    assert got.kv_indptr == [0, 3, 4, 14, 15]
    assert got.kv_indices == [7, 8, 9, 3, *range(11, 21), scratch]  # the padding row attends its scratch page
