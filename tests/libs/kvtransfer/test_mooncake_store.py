"""The store tier on a real Mooncake Store (mooncake_master on loopback, TCP): a prompt computed by one
engine ("decode-0") is served to another ("decode-1") from the store with the same greedy tokens; with
the master gone the second engine recomputes, same tokens, no error. The master's port is the kernel's."""

from __future__ import annotations

import time

import pytest

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.launch.mooncake_master import argv, listening_ports, start_mooncake_master

pytest.importorskip("mooncake.store")
from libs.kvtransfer.mooncake_store import MooncakePageStore  # noqa: E402

PS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)  # another thread's progress: nothing to wait on but its state


def _engine(model, master: str) -> Engine:
    engine = Engine(model, page_size=PS, num_pages=64, host_kv_pages=32)
    store = MooncakePageStore(master, segment_bytes=16 << 20)
    tier = engine.attach_store(store, "mc-test", timeout_s=2.0, retry_s=30.0)
    _until(lambda: tier.available, "connected to the Mooncake master")
    return engine


def test_a_prefix_computed_on_decode_0_is_served_to_decode_1_from_the_mooncake_store(tmp_path) -> None:
    ref = Engine.from_pretrained(write_tiny_model(tmp_path / "tiny", seed=2), page_size=PS, num_pages=128,
                                 enable_prefix_cache=False)  # fmt: skip
    prompt, other = list(range(5, 42)), list(range(60, 97))
    want = ref.generate([prompt, other], GREEDY)
    master = start_mooncake_master()
    try:
        assert master.port in listening_ports(master.proc.pid)
        assert f"--rpc_port={master.port}" in argv("127.0.0.1", master.port)  # a restart binds it again
        d0, d1 = _engine(ref.model, master.address), _engine(ref.model, master.address)
        assert d0.generate([prompt], GREEDY)[0].token_ids == want[0].token_ids

        def published() -> bool:
            assert d0.store_tier is not None
            d0.store_tier.poll()
            return d0.tier_stats()["store_published_pages"] >= 9

        _until(published, "decode-0's pages in the store")
        out = d1.generate([prompt], GREEDY)[0]
        assert out.token_ids == want[0].token_ids and out.cached_tokens == 9 * PS
        assert d1.tier_stats()["store_hit_pages"] == 9
        master.stop()  # outage: decode-1 recomputes what it does not cache
        out = d1.generate([other], GREEDY)[0]
        assert out.token_ids == want[1].token_ids and out.cached_tokens == 0
        for e in (d0, d1):
            e.close()
    finally:
        master.stop()
