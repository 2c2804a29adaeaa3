"""PD between two EP groups whose ranks keep their own KV pools (what GPUs need), on CPU: every rank
registers its pool with its own Mooncake TCP engine; the decode group names the rank holding a request;
the prefill group's rank holding the prompt writes straight into that rank's pool. The bytes must land in
the named rank's pool (and nowhere else), and decoding there must give the group's own greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from libs.engine import SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.ep.engine import EPEngine
from libs.kvtransfer import SkipTransport
from libs.kvtransfer.ranks import join_rank_pages
from libs.worker.rank_pools import handle_place, rank_pools

PAGES = 24  # per rank
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TCP = ("tcp", "127.0.0.1", "")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("rank-kv") / "tiny", seed=0)


@pytest.fixture(scope="module")
def groups(tiny: Path) -> Iterator[tuple[EPEngine, EPEngine]]:
    with (
        EPEngine(str(tiny), ep_size=2, num_pages=PAGES, max_prefill_tokens=32, ep_kv_transfer=TCP) as prefill,
        EPEngine(str(tiny), ep_size=2, num_pages=PAGES, max_prefill_tokens=32, ep_kv_transfer=TCP) as decode,
    ):
        yield prefill, decode


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 1000 + 3 for i in range(n)]


def test_each_rank_registers_its_own_pool(groups: tuple[EPEngine, EPEngine]) -> None:
    _, decode = groups
    pools = rank_pools(decode)
    assert [p.rank for p in pools] == [0, 1]
    assert len({p.session_id for p in pools}) == 2  # two Mooncake engines, one per rank process
    assert all(p.geometry.num_pages == PAGES for p in pools)
    with pytest.raises(RuntimeError, match="KV pool per rank"):
        _ = decode.kv_pool  # no one pool to register


def test_prefill_rank_writes_into_the_named_decode_ranks_pool(groups: tuple[EPEngine, EPEngine]) -> None:
    prefill, decode = groups
    p = prompt(40, 3)  # 3 pages of 16
    decode.reserve("pad", 20)  # the next reservation goes to the other rank: not always rank 0
    res = prefill.prefill("pd", p, GREEDY)
    pages = decode.reserve("pd", len(p))
    session, rank, local = handle_place(decode, SkipTransport(), "pd", pages)
    assert rank == 1 and session == rank_pools(decode)[1].session_id and len(local) == len(res.page_ids)
    dst = rank_pools(decode)[rank].geometry
    geom = {f: getattr(dst, f) for f in type(dst).__struct_fields__}
    layers = decode.config.num_hidden_layers
    nbytes = prefill.write_kv(res.page_ids, session, geom, local, layers)
    assert nbytes == len(local) * layers * dst.page_bytes

    sent = prefill.read_kv(res.page_ids)
    assert np.abs(sent.view(np.float32)).sum() > 0  # the prompt's KV is there to send
    np.testing.assert_array_equal(decode.read_kv(pages), sent)  # landed in rank 1's pages
    other = decode.read_kv(join_rank_pages(0, local, PAGES))  # rank 0's same page ids: untouched
    assert not other.any()

    decode.add_prefilled("pd", p, res.first_token, GREEDY)
    prefill.release("pd")
    decode.cancel_reservation("pad")
    tokens = [res.first_token]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.token_ids]
    assert tokens == decode.generate([p], GREEDY)[0].token_ids


def test_rank_kv_calls_refuse_bad_pages(groups: tuple[EPEngine, EPEngine]) -> None:
    _, decode = groups
    with pytest.raises(ValueError, match="do not belong to one rank"):
        decode.read_kv([PAGES - 1, PAGES])
    with pytest.raises(ValueError, match="outside"):
        decode.group.call(0, "read_kv", [PAGES])
