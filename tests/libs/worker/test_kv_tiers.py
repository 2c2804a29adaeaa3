"""The worker side of the KV tiers: the store namespace names the checkpoint and KV layout (equal for
equal checkpoints, different for different weights or page sizes, or as set), and the tier metrics read
the engine's counters at scrape time."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.worker.kv_tiers import KvTierCollector, store_namespace
from libs.worker.settings import WorkerSettings


def test_the_store_namespace_names_checkpoint_and_layout(tmp_path: Path) -> None:
    a, b, c = (write_tiny_model(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    engines = {ps: Engine.from_pretrained(a, page_size=ps, num_pages=8) for ps in (4, 8)}

    def ns(path: Path, ps: int = 4, **kw: str) -> str:
        return store_namespace(WorkerSettings(model_dir=str(path), **kw), engines[ps])

    assert ns(a) == ns(b) != ns(c)  # the same weights in two folders share pages; other weights do not
    assert ns(a, 4) != ns(a, 8)
    assert ns(a, kv_store_namespace="mine") == "mine"


def test_tier_metrics_read_the_engines_counters(tmp_path: Path) -> None:
    engine = Engine.from_pretrained(
        write_tiny_model(tmp_path / "m", seed=0), page_size=4, num_pages=12, host_kv_pages=16
    )
    registry = CollectorRegistry()
    registry.register(KvTierCollector(engine))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for p in (list(range(3, 30)), list(range(40, 67)), list(range(3, 30))):  # the third comes back from host
        engine.generate([p], params)
    text = generate_latest(registry).decode()
    st = engine.tier_stats()
    assert st["host_hit_pages"] > 0
    assert f'moemesh_kv_tier_hit_pages_total{{tier="host"}} {float(st["host_hit_pages"])}' in text
    assert 'moemesh_kv_host_pages{state="total"} 16.0' in text
    assert "moemesh_kv_store_up" not in text  # no store attached
