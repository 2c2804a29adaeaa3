import pytest
import torch

from libs.engine.kv_pool import KVPool
from libs.kvtransfer import (
    InProcessTransport,
    KvTransport,
    MooncakeTransport,
    PageGeometry,
    TransferError,
    make_transport,
    plan_page_runs,
)
from libs.kvtransfer.base import split_batches


@pytest.fixture(scope="module")
def mooncake_pair():
    """Shared by the module: releasing a Mooncake engine takes about a second."""
    a, b = MooncakeTransport("tcp"), MooncakeTransport("tcp")
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def inprocess_pair():
    a, b = InProcessTransport(), InProcessTransport()
    yield a, b
    a.close()
    b.close()
    assert a.session_id not in InProcessTransport.live_sessions()


class Registering:
    """Wraps a transport so every region a test registers is unregistered after it (pools are freed and
    their addresses reused by the next test)."""

    def __init__(self, t: KvTransport):
        self.t, self.ptrs = t, []

    def __getattr__(self, name):
        return getattr(self.t, name)

    def register(self, ptr, length):
        self.t.register(ptr, length)
        self.ptrs.append(ptr)


@pytest.fixture(params=["mooncake", "inprocess"])
def pair(request):
    wrapped = [Registering(t) for t in request.getfixturevalue(f"{request.param}_pair")]
    yield wrapped
    for w in wrapped:
        for ptr in w.ptrs:
            w.t.unregister(ptr)


def make_pools():
    src = KVPool(num_layers=4, num_pages=32, page_size=16, row_dim=72, dtype=torch.bfloat16)
    dst = KVPool(num_layers=4, num_pages=48, page_size=16, row_dim=72, dtype=torch.bfloat16)
    src.buffer.copy_(torch.randn(src.buffer.shape))
    return src, dst


def test_pages_move_between_pools(pair):
    a, b = pair
    src, dst = make_pools()
    a.register(src.data_ptr(), src.nbytes)
    b.register(dst.data_ptr(), dst.nbytes)
    src_pages, dst_pages = [3, 4, 5, 6, 20, 7], [40, 41, 42, 43, 10, 0]
    runs = plan_page_runs(4, src_pages, dst_pages, PageGeometry.of_pool(src), PageGeometry.of_pool(dst))
    assert len(runs) == 4 * 3  # per layer: 3..6 -> 40..43 merged, then two single pages
    assert a.write(b.session_id, runs) == 4 * 6 * src.bytes_per_page
    s = src.buffer.view(4, 32, 16, 72)
    d = dst.buffer.view(4, 48, 16, 72)
    assert torch.equal(d[:, dst_pages], s[:, src_pages])
    untouched = [p for p in range(48) if p not in dst_pages]
    assert not d[:, untouched].any()


def test_write_outside_registered_memory_fails(pair):
    a, b = pair
    src, dst = make_pools()
    a.register(src.data_ptr(), src.nbytes)
    b.register(dst.data_ptr(), dst.nbytes // 2)
    with pytest.raises(TransferError):
        a.write(b.session_id, [(src.data_ptr(), dst.data_ptr() + dst.nbytes - 64, 64)])
    assert a.write(b.session_id, [(src.data_ptr(), dst.data_ptr(), 64)]) == 64  # the endpoint still works


def test_malformed_runs_are_value_errors(pair):
    a, b = pair
    with pytest.raises(ValueError, match="positive"):
        a.write(b.session_id, [(1, 2, 0)])
    with pytest.raises(ValueError, match="src_addr, dst_addr, length"):
        a.write(b.session_id, [(1, 2)])
    with pytest.raises(ValueError, match="positive"):
        a.register(0, 10)


def test_unknown_peer_fails(pair):
    a, _ = pair
    src, _ = make_pools()
    a.register(src.data_ptr(), src.nbytes)
    peer = "127.0.0.1:1" if isinstance(a.t, MooncakeTransport) else "inproc:nobody"
    with pytest.raises(TransferError, match="failed|no in-process endpoint"):
        a.write(peer, [(src.data_ptr(), 0x1000, 64)])


def test_mooncake_session_and_close():
    t = MooncakeTransport("tcp", hostname="127.0.0.1")
    host, port = t.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    t.close()
    t.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        t.write("127.0.0.1:1", [(1, 1, 1)])


def test_bad_protocol_and_factory():
    with pytest.raises(ValueError, match="unknown Mooncake protocol 'udp'"):
        MooncakeTransport("udp")
    t = make_transport("inprocess")
    assert isinstance(t, InProcessTransport)
    t.close()


def test_split_batches_bounds_every_call_and_keeps_every_byte() -> None:
    runs = [(1000, 5000, 300), (2000, 9000, 50), (4000, 12000, 700)]
    batches = split_batches(runs, max_bytes=256)
    assert all(sum(n for _, _, n in b) <= 256 for b in batches)
    assert [sum(n for _, _, n in b) for b in batches[:-1]] == [256] * (len(batches) - 1)  # full but the last
    flat = [r for b in batches for r in b]
    # the same bytes, in order, each piece at the same offset on both sides
    assert sum(n for _, _, n in flat) == 1050
    covered = [(s + i, d + i) for s, d, n in flat for i in range(n)]
    assert covered == [(s + i, d + i) for s, d, n in runs for i in range(n)]
    with pytest.raises(ValueError):
        split_batches(runs, max_bytes=0)


def test_a_write_larger_than_one_batch_lands_whole(mooncake_pair, monkeypatch) -> None:
    """MooncakeTransport cuts a write into several calls (the binding holds the GIL per call): all land."""
    import libs.kvtransfer.mooncake as mc

    assert mooncake_pair[0].max_batch_bytes == mc.MAX_BATCH_BYTES  # TCP's bound
    real = mc.split_batches
    calls: list[int] = []

    def counted(runs, max_bytes):
        out = real(runs, max_bytes)
        calls.append(len(out))
        return out

    monkeypatch.setattr(mc, "split_batches", counted)
    monkeypatch.setattr(mooncake_pair[0], "max_batch_bytes", 4096)
    a, b = (Registering(t) for t in mooncake_pair)
    src, dst = make_pools()
    a.register(src.data_ptr(), src.nbytes)
    b.register(dst.data_ptr(), dst.nbytes)
    try:
        runs = plan_page_runs(
            4, list(range(8)), list(range(8, 16)), PageGeometry.of_pool(src), PageGeometry.of_pool(dst)
        )
        assert a.write(b.session_id, runs) == 4 * 8 * src.bytes_per_page
        assert calls and calls[0] > 1
        s, d = src.buffer.view(4, 32, 16, 72), dst.buffer.view(4, 48, 16, 72)
        assert torch.equal(d[:, 8:16], s[:, 0:8])
    finally:
        for w in (a, b):
            for ptr in w.ptrs:
                w.t.unregister(ptr)


def test_fp8_pages_move_with_their_scales(pair):
    """FP8 pools (kv_cache_dtype fp8_e4m3): a page is its rows' codes, bf16 k_pe and scales, moved as bytes; the
    destination reads back the source's values."""
    from libs.engine.kv_fp8 import Fp8Rows

    fmt = Fp8Rows(64, 8)
    a, b = pair
    src, dst = (KVPool(num_layers=2, num_pages=n, page_size=16, row_dim=72, fp8=fmt) for n in (8, 12))
    src.write(1, torch.arange(16, 48), torch.randn(32, 72) * torch.logspace(-2, 2, 32)[:, None])  # pages 1, 2
    a.register(src.data_ptr(), src.nbytes)
    b.register(dst.data_ptr(), dst.nbytes)
    runs = plan_page_runs(2, [1, 2], [9, 4], PageGeometry.of_pool(src), PageGeometry.of_pool(dst))
    assert a.write(b.session_id, runs) == 2 * 2 * 16 * fmt.row_bytes  # 2 layers x 2 pages of 96-byte rows
    assert torch.equal(dst.gather(1, torch.tensor([9, 4]), 32), src.gather(1, torch.tensor([1, 2]), 32))
