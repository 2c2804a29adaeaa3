"""The leak check's arithmetic on engine stats, and on a real engine: cached prefix pages are not leaks,
and a finished workload leaves no request pages behind."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.worker.page_accounting import install_page_gauges, leaked_pages, page_account


def test_account_separates_cached_pages_and_flags_leaks_only_when_idle() -> None:
    busy = page_account({"used_pages": 10, "cached_pages": 4, "running": 1, "waiting": 0, "reserved": 1})
    assert busy == {"used_pages": 10, "cached_pages": 4, "request_pages": 6, "live_requests": 2}
    assert leaked_pages(busy) == 0
    idle = page_account({"used_pages": 7, "cached_pages": 4, "running": 0, "waiting": 0, "pinned": 0})
    assert leaked_pages(idle) == 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def test_engine_after_traffic_has_only_cached_pages(engine: Engine) -> None:
    reg = CollectorRegistry()
    install_page_gauges(reg, engine.stats)
    prompt = list(range(3, 3 + 40))
    engine.generate([prompt, prompt[:20]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.reserve("pd", 33)
    during = page_account(engine.stats())
    assert during["live_requests"] == 1 and during["request_pages"] >= 3
    engine.cancel_reservation("pd")
    after = page_account(engine.stats())
    assert after["cached_pages"] > 0 and after["request_pages"] == 0 and after["live_requests"] == 0
    text = generate_latest(reg).decode()
    assert "moemesh_kv_leaked_pages 0.0" in text and "moemesh_kv_request_pages 0.0" in text
