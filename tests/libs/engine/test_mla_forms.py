"""MLA's two torch forms on a GPU in bf16: the absorbed (latent-space) decode must equal the expanded
(SDPA) form on the same paged pool (libs.engine.layers.mla; no kernels of libs.kernels involved). The Triton
and FlashInfer backends are checked against these in tests/libs/engine/test_cuda_graph.py."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_absorbed_decode_matches_expanded_on_gpu():
    from libs.engine.forward_batch import ForwardBatch
    from libs.engine.layers.mla import AttentionMetadata, mla_absorbed, mla_expanded

    g = torch.Generator().manual_seed(0)
    h, n, v, r, rank, page = 16, 128, 128, 64, 512, 16
    seq_lens = [5, 40, 77]
    tables = [torch.randperm(20, generator=g)[: -(-s // page)] + 20 * i for i, s in enumerate(seq_lens)]
    batch = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.long), positions=torch.tensor([s - 1 for s in seq_lens]),
        out_slots=torch.zeros(3, dtype=torch.long), extend_lens=[1, 1, 1], seq_lens=seq_lens, page_tables=tables,
    )  # fmt: skip
    meta = AttentionMetadata.from_batch(batch, page, torch.device("cuda"))
    rows = torch.randn(60 * page, rank + r, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(h * (n + v), rank, generator=g) / rank**0.5).to(torch.bfloat16).cuda()
    q_nope = torch.randn(3, h, n, generator=g).to(torch.bfloat16).cuda()
    q_pe = torch.randn(3, h, r, generator=g).to(torch.bfloat16).cuda()
    got = mla_absorbed(q_nope, q_pe, rows, w, meta, 0.07)
    ref = mla_expanded(q_nope.float(), q_pe.float(), rows.float(), w.float(), meta, 0.07)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2
