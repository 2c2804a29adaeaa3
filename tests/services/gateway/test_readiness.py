"""The gateway's readiness rule (pure): a live scheduler and a live, non-draining decode worker of the
served model; prompts take a prefill worker when one is live, else the decode-local path."""

from __future__ import annotations

from proto import messages as m
from services.gateway.readiness import MeshReadiness


def hb(
    wid: str, role: m.Role = m.Role.DECODE, model: str = "tiny", draining: bool = False
) -> m.WorkerHeartbeat:
    return m.WorkerHeartbeat(
        worker_id=wid, role=role, model=model, running=0, waiting=0, free_pages=8, total_pages=8,
        page_size=16, max_context=256, interval_ms=100, sent_ms=0, draining=draining,
    )  # fmt: skip


SCHED = m.SchedulerHeartbeat(scheduler_id="sched-0", interval_ms=100, sent_ms=0)


def test_ready_needs_a_decode_worker_of_the_model_and_a_scheduler() -> None:
    r = MeshReadiness("tiny", dead_after_intervals=3)
    assert r.check(0.0).reason == "no live decode worker for model 'tiny'"
    r.observe(SCHED, 0.0)
    r.observe(hb("d-other", model="big"), 0.0)
    assert r.check(0.0).reason == "no live decode worker for model 'tiny' (live decode workers serve 'big')"
    r.observe(hb("d0", draining=True), 0.0)
    assert r.check(0.0).reason is not None
    r.observe(hb("d0"), 0.0)
    ok = r.check(0.1)
    assert ok.reason is None and (ok.decode_workers, ok.prefill_workers, ok.schedulers) == (1, 0, 1)
    assert ok.prompt_path == "decode-local prefill"
    r.observe(hb("p0", role=m.Role.PREFILL), 0.1)
    assert r.check(0.1).prompt_path == "prefill-worker"


def test_a_silent_or_gone_worker_or_scheduler_ends_readiness() -> None:
    r = MeshReadiness("tiny", dead_after_intervals=3)
    r.observe(SCHED, 0.0)
    r.observe(hb("d0"), 0.0)
    assert r.check(0.3).reason is None  # 3 intervals of 100 ms: still alive at 0.3 s
    assert r.check(0.31).reason == "no live decode worker for model 'tiny'"
    r.observe(hb("d0"), 1.0)
    r.observe(SCHED, 1.0)
    assert r.check(1.0).reason is None
    r.observe(m.WorkerGone(worker_id="d0", role=m.Role.DECODE), 1.0)
    assert r.check(1.0).reason is not None  # at once, not after the silence
    r.observe(hb("d0"), 2.0)
    assert r.check(2.0).reason == "no live scheduler"  # the scheduler last beat at 1.0
