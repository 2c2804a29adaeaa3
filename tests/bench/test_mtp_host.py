"""bench.mtp_host on CPU: MTPEngine on the GPU's verify/draft graph path, its replays emulated
(HostRowRunner). Greedy tokens equal the plain engine's with drafts accepted, a greedy step reads the
device once (the drafts come with the verify's argmax), sampled requests run, no page leaks; and the
bench's --host row."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench import mtp_host
from libs.engine import Engine, SamplingParams
from libs.engine.speculative import MTPEngine
from libs.engine.tiny import write_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 40, 41], list(range(100, 137)), [300]]
KW: dict[str, Any] = dict(
    page_size=4, max_prefill_tokens=16, attention_backend="triton", enable_prefix_cache=False
)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("host"), seed=3, num_nextn_predict_layers=1)


def _graphed(path, k: int) -> tuple[MTPEngine, mtp_host.Clock]:
    engine = MTPEngine.load(path, mtp_k=k, **KW)
    clock = mtp_host.Clock()
    mtp_host.host_graphs(engine, clock, max_len=96)
    return engine, clock


def _steady(engine: MTPEngine) -> bool:
    """Every running request decodes with all k drafts of the last step (no join, prefill or end near)."""
    drafts = [engine._drafts.get(r.rid) for r in engine.running]
    batches = {id(d.batch) if d is not None else None for d in drafts}
    if engine.waiting or not all(r.in_decode for r in engine.running):
        return False
    return bool(drafts) and None not in batches and len(batches) == 1 and all(d.n == engine.k for d in drafts)  # type: ignore[union-attr]


@pytest.mark.parametrize("k", [1, 3])
def test_graph_path_is_greedy_identical_with_one_device_read_per_step(path, k):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in Engine.from_pretrained(path, **KW).generate(PROMPTS, params)]
    engine, clock = _graphed(path, k)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    steady: list[int] = []  # host reads of each steady decode step
    with clock.counting_reads():
        while engine.has_unfinished():
            before, is_steady = clock.reads, _steady(engine)
            for o in engine.step():
                out[o.rid].extend(o.token_ids)
            if is_steady:
                steady.append(clock.reads - before)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == ref
    assert engine.num_drafted > 0 and engine.verify_graphs is not None and engine.verify_graphs.captured
    assert engine.draft_graphs is not None and engine.draft_graphs.captured
    assert len(steady) > 5 and set(steady) == {1}  # one host read (device sync) per step, not k + 1
    assert engine.stats()["used_pages"] == 1  # the emulation's scratch page only


def test_graph_path_sampled_requests_run(path):
    engine, _ = _graphed(path, 2)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=1, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 16 for o in outs) and engine.num_drafted > 0
    again, _ = _graphed(path, 2)
    assert [o.token_ids for o in again.generate(PROMPTS, params)] == [o.token_ids for o in outs]


def test_host_bench_row(path):
    args = argparse.Namespace(model=str(path), batches="2", ks="1", host_steps=4, prompt_len=8, threads=1)
    rows = mtp_host.run(args)["results"]
    assert [(r["batch"], r["k"]) for r in rows] == [(2, 0), (2, 1)]
    assert rows[1]["host_reads_per_step"] == 1.0 and rows[1]["host_ms"] > 0
