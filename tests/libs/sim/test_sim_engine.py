"""The timing-model engine: deterministic tokens on every path, modeled waits, and the real Engine's paging,
prefix cache and cache events underneath."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from libs.engine import SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.prefix import block_hashes
from libs.sim import SimEngine, StepTimeModel, next_token
from libs.worker.settings import WorkerSettings
from libs.worker.startup import load_engine
from tests.libs.cache_recorder import Recorder

PS = 4
FAST = StepTimeModel(prefill_fixed_ms=0.0, prefill_per_token_ms=0.01, speed=10.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _engine(ckpt: Path, timing: StepTimeModel = FAST, num_pages: int = 64) -> SimEngine:
    return SimEngine.from_checkpoint(ckpt, timing, page_size=PS, num_pages=num_pages, max_num_seqs=8)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 200 + 3 for i in range(n)]


def test_tokens_are_a_function_of_the_last_token_and_position_and_never_end_ids(ckpt: Path) -> None:
    eng = _engine(ckpt)
    prompt = _prompt(10)
    [out] = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.8, seed=None))
    expect, prev = [], prompt[-1]
    for i in range(12):
        prev = next_token(prev, len(prompt) + i, eng.config.vocab_size, eng.eos_ids)
        expect.append(prev)
    assert out.token_ids == expect and out.finish_reason == "length"
    assert not set(out.token_ids) & set(eng.eos_ids)
    assert next_token(5, 9, 10, avoid=(next_token(5, 9, 10),)) != next_token(5, 9, 10)


def test_pd_path_gives_the_direct_path_tokens_and_frees_every_page(ckpt: Path) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = _prompt(13, salt=1)
    [direct] = _engine(ckpt).generate([prompt], params)
    prefill, decode = _engine(ckpt), _engine(ckpt)
    res = prefill.prefill("r", prompt, params)
    cached, pages = decode.reserve_cached("r", prompt)
    assert cached == 0 and len(pages) == -(-len(prompt) // PS)
    assert prefill.release("r")
    decode.add_prefilled("r", prompt, res.first_token, params)
    tokens = [res.first_token]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.token_ids]
    assert tokens == direct.token_ids
    for eng in (prefill, decode):
        st = eng.stats()
        assert st["used_pages"] == st["cached_pages"] and st["reserved"] == st["pinned"] == 0


def test_a_decode_step_waits_the_modeled_time(ckpt: Path) -> None:
    timing = StepTimeModel(prefill_fixed_ms=0.0, prefill_per_token_ms=0.0)
    eng = _engine(ckpt, timing)
    prompts = [_prompt(9, salt=s) for s in range(4)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()  # the four prefills
    before = eng.runner.modeled_s
    t0 = time.perf_counter()
    outs = eng.step()  # one decode step of four sequences at 10 tokens each
    elapsed = time.perf_counter() - t0
    modeled = timing.forward_ms([1] * 4, [10] * 4) / 1000
    assert len(outs) == 4 and eng.runner.modeled_s - before == pytest.approx(modeled)
    assert elapsed >= modeled


def test_prefix_cache_and_its_events_are_the_real_engines(ckpt: Path) -> None:
    eng, rec = _engine(ckpt), Recorder()
    eng.set_cache_listener(rec)
    shared = _prompt(12, salt=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [first] = eng.generate([shared + [9]], params)
    [second] = eng.generate([shared + [11, 12]], params)
    assert first.cached_tokens == 0 and second.cached_tokens == 12
    assert set(block_hashes(shared, PS)) <= rec.held()
    assert eng.flush_prefix_cache() > 0 and rec.held() == set()
    assert eng.stats()["used_pages"] == 0


def test_a_worker_with_engine_sim_loads_no_weights_and_a_scaled_down_pool(ckpt: Path) -> None:
    s = WorkerSettings(
        model_dir=str(ckpt), engine="sim", num_pages=100, page_size=PS, transfer_protocol="skip"
    )
    eng = load_engine(s)
    assert isinstance(eng, SimEngine) and eng.kv_pool.nbytes == 100 * PS  # one byte per token
    with pytest.raises(ValueError, match="engine must be"):
        WorkerSettings(model_dir=str(ckpt), engine="gpu")
    with pytest.raises(ValueError, match="ep_size must be 1"):
        WorkerSettings(model_dir=str(ckpt), engine="sim", ep_size=2)


def test_skip_transport_counts_the_planned_bytes_and_refuses_bad_runs() -> None:
    from libs.kvtransfer import SkipTransport, make_transport

    t = make_transport("skip")
    assert isinstance(t, SkipTransport) and t.session_id.startswith("skip:")
    assert t.write("skip:other", [(4096, 8192, 64), (4160, 8256, 16)]) == 80 and t.bytes_planned == 80
    with pytest.raises(ValueError):
        t.write("skip:other", [(0, 8192, 64)])
