"""Worker warm-up: when it runs, what it plans (every bucket of M a prefill step can take, every decode graph
size, within the pool and the context), and that it leaves the engine as it found it."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.engine import Engine, SamplingParams
from libs.engine.cuda_graph import capture_sizes
from libs.engine.tiny import write_tiny_model
from libs.kernels.gemm_tuning import m_bucket
from libs.worker.settings import WorkerSettings
from libs.worker.warmup import DECODE_TOKENS, plan_warmup, run_warmup, warmup_enabled


def test_auto_is_on_for_a_model_on_cuda_only() -> None:
    assert warmup_enabled("auto", "cuda", "model") and warmup_enabled("auto", "cuda:1", "model")
    assert not warmup_enabled("auto", "cpu", "model")
    assert not warmup_enabled("auto", "cuda", "sim")
    assert warmup_enabled("on", "cpu", "model") and not warmup_enabled("off", "cuda", "model")
    with pytest.raises(ValueError, match="warmup must be auto, on or off"):
        WorkerSettings(model_dir="m", warmup="always")


def test_prefill_lengths_cover_every_bucket_up_to_max_prefill_tokens() -> None:
    plan = plan_warmup(3000, 256, page_size=16, free_pages=10_000, context_len=8192, decode=False)
    assert plan.prefill_lens[-1] == 3000 and plan.decode_batches == ()
    assert {m_bucket(n) for n in plan.prefill_lens} == {m_bucket(t) for t in range(1, 3001)}
    assert len(plan.prefill_lens) == 13  # 1 .. 2048, then 3000: a few prompts, not one per length


def test_decode_batches_are_the_graph_sizes_that_fit_the_pool() -> None:
    plan = plan_warmup(64, 256, page_size=16, free_pages=10_000, context_len=8192, decode=True)
    assert plan.decode_batches == tuple(capture_sizes(256))
    small = plan_warmup(64, 256, page_size=2, free_pages=100, context_len=8192, decode=True)
    per_seq = -(-(2 + DECODE_TOKENS) // 2)  # every other request makes one token more
    assert small.decode_batches == tuple(b for b in capture_sizes(256) if b * per_seq <= 100)
    assert small.decode_batches[-1] == 32


def test_prompts_stay_within_the_context_and_the_pool() -> None:
    by_context = plan_warmup(16384, 8, page_size=16, free_pages=10_000, context_len=1000, decode=False)
    assert by_context.prefill_lens[-1] == 999
    by_pool = plan_warmup(16384, 8, page_size=16, free_pages=20, context_len=8192, decode=False, copies=2)
    assert by_pool.prefill_lens[-1] == 10 * 16 - 1  # two copies at once share the pool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)


def _engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, page_size=4, num_pages=64, max_num_seqs=8, max_prefill_tokens=40)


def test_warmup_leaves_no_page_behind_and_changes_no_output(model_dir: Path) -> None:
    engine = _engine(model_dir)
    before = engine.stats()
    plan = plan_warmup(40, 8, page_size=4, free_pages=before["free_pages"], context_len=4096, decode=True)
    report = run_warmup(engine, plan)
    assert report.prompts == len(plan.prefill_lens) + sum(plan.decode_batches) and report.seconds > 0
    assert plan.prefill_lens == (1, 2, 4, 8, 16, 32, 40) and plan.decode_batches == (1, 2, 4, 8)
    assert engine.stats() == before  # every page free again, the prefix cache empty
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = [(5 * i + 7) % 300 + 3 for i in range(30)]
    fresh = _engine(model_dir).generate([prompt], params)[0].token_ids
    assert engine.generate([prompt], params)[0].token_ids == fresh


def test_warmup_fails_loudly_when_pages_stay_held(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.prefill("pinned", [3, 4, 5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))  # pinned pages
    free = engine.stats()["free_pages"]
    plan = plan_warmup(8, 2, page_size=4, free_pages=free, context_len=4096, decode=False)
    with pytest.raises(RuntimeError, match="warm-up left work or pages behind"):
        run_warmup(engine, plan)


def test_a_failing_step_is_named(model_dir: Path) -> None:
    engine = _engine(model_dir)  # 64 pages of 4 tokens: a 300-token prompt cannot fit
    plan = plan_warmup(300, 2, page_size=4, free_pages=10_000, context_len=4096, decode=False)
    with pytest.raises(RuntimeError, match="warm-up failed on a prefill of 256 tokens: ValueError"):
        run_warmup(engine, plan)
    engine.flush_prefix_cache()  # the shorter prompts' pages stay cached until then
    assert engine.stats()["used_pages"] == 0  # the failed generate took back what it had


class _Recorder:
    """Just enough of an engine for run_warmup: records each generate call's batch size and tokens."""

    def __init__(self) -> None:
        self.config = type("C", (), {"vocab_size": 1000})()
        self.calls: list[tuple[int, int]] = []  # (prompts, least max_tokens)
        self.lengths: list[list[int]] = []  # each call's distinct max_tokens

    def generate(self, batch, params):
        tokens = {p.max_tokens for p in params} if isinstance(params, list) else {params.max_tokens}
        self.calls.append((len(batch), min(tokens)))
        self.lengths.append(sorted(tokens))
        return []

    def flush_prefix_cache(self) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {"used_pages": 0, "running": 0, "waiting": 0}


def test_every_ep_rank_gets_each_decode_graph_size() -> None:
    """An EP worker of 2 ranks (copies=2) sends 2 x b one-token prompts for decode batch b, so the EP engine's
    least-busy placement gives each rank b, and the pool check counts both ranks' prompts."""
    plan = plan_warmup(8, 8, page_size=16, free_pages=10, context_len=8192, decode=True, copies=2)
    assert plan.decode_batches == (1, 2, 4)  # 4 x 2 ranks x 1 page each fits 10 pages, 8 x 2 does not
    rec = _Recorder()
    run_warmup(rec, plan)  # type: ignore[arg-type]
    assert [n for n, t in rec.calls if t == DECODE_TOKENS] == [2, 4, 8]
    assert [n for n, t in rec.calls if t == 1] == [2] * len(plan.prefill_lens)
    # each decode batch ends in two lengths: its last step runs a smaller batch than the one before
    assert rec.lengths[-3:] == [[DECODE_TOKENS, DECODE_TOKENS + 1]] * 3


def test_each_stage_is_timed_in_the_log(caplog) -> None:
    """One log line with seconds per stage, in the report too."""
    import logging

    plan = plan_warmup(4, 2, page_size=16, free_pages=10, context_len=8192, decode=True)
    with caplog.at_level(logging.INFO, logger="moemesh.worker.warmup"):
        report = run_warmup(_Recorder(), plan)  # type: ignore[arg-type]
    names = [f"a prefill of {n} tokens" for n in plan.prefill_lens] + [
        f"a decode batch of {b}" for b in plan.decode_batches
    ]
    assert [name for name, _ in report.stages] == names and all(s >= 0 for _, s in report.stages)
    lines = [r.getMessage() for r in caplog.records if r.name == "moemesh.worker.warmup"]
    assert len(lines) == len(names)
    for line, name in zip(lines, names, strict=True):
        assert line.startswith(f"warm-up: {name}: ") and line.endswith(" s")
