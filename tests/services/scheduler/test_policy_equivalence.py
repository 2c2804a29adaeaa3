"""The policy's single-pass choices (written for speed: they run per placement over every worker) pick
exactly what `min` over the documented keys picks: the reference below is the rule as the module's
docstring states it, evaluated with WorkerState's own properties and `placement_score`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proto.messages import Role
from services.scheduler.policy import (
    Plan,
    PlanKind,
    PolicyConfig,
    Refuse,
    Wait,
    WorkerState,
    placement_score,
    schedule,
)
from tests.services.scheduler.factories import make_heartbeat, make_request, make_workers


def reference(ws: list[WorkerState], plen: int, max_tokens: int, cfg: PolicyConfig, hits: dict[str, int]):
    """schedule's decision for a request every worker can serve (same model, fits every context)."""
    placed = hits if cfg.prefix_weight > 0 else {}

    def score(w: WorkerState, load: int) -> float:
        return placement_score(load, placed.get(w.worker_id, 0), plen, cfg.prefix_weight)

    dec = [w for w in ws if w.role == Role.DECODE and not w.hb.draining]
    roomy = [w for w in dec if w.free_pages >= w.pages_for(plen + max_tokens)]
    if not roomy:
        return "wait"
    d = min(
        roomy,
        key=lambda w: (-score(w, w.decode_load), -w.free_pages, -placed.get(w.worker_id, 0), w.worker_id),
    )
    if 0 < cfg.direct_prefill_threshold >= max(0, plen - hits.get(d.worker_id, 0)):
        return (d.worker_id, None)
    pre = [w for w in ws if w.role == Role.PREFILL and not w.hb.draining]
    if not pre:
        return "refuse"
    pre = [w for w in pre if not w.suspended]
    if not pre:
        return "wait"
    p = min(
        pre,
        key=lambda w: (-score(w, w.prefill_load), w.prefill_tokens, -placed.get(w.worker_id, 0), w.worker_id),
    )
    return (d.worker_id, p.worker_id)


worker = st.tuples(
    st.sampled_from([Role.DECODE, Role.PREFILL]),
    st.integers(0, 6),  # running
    st.integers(0, 4),  # waiting
    st.integers(0, 64),  # free pages
    st.integers(0, 300),  # waiting tokens
    st.booleans(),  # draining
    st.booleans(),  # suspended
    st.integers(0, 3),  # inflight placements
    st.sampled_from([0, 16, 32, 64, 96, 200]),  # cached prompt tokens
)


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(worker, min_size=2, max_size=12),
    plen=st.integers(1, 200),
    weight=st.sampled_from([0.0, 1.0, 8.0]),
    threshold=st.sampled_from([0, 32, 256]),
)
def test_choices_match_the_documented_keys(specs, plen: int, weight: float, threshold: int) -> None:
    hbs = [make_heartbeat(f"w{i}", role, running=run, waiting=wait, free_pages=free, waiting_tokens=wt, draining=dr)
           for i, (role, run, wait, free, wt, dr, *_rest) in enumerate(specs)]  # fmt: skip
    table = make_workers(*hbs)
    hits = {}
    for i, (_, _, _, _, _, _, suspended, inflight, cached) in enumerate(specs):
        for _ in range(inflight):
            table.note_placement(f"w{i}", pages=1, tokens=5)
        if suspended:
            table.suspend(f"w{i}")
        if cached:
            hits[f"w{i}"] = cached
    cfg = PolicyConfig(direct_prefill_threshold=threshold, prefix_weight=weight)
    live = table.live(0.0)
    got = schedule(live, make_request(prompt_len=plen, max_tokens=16), cfg, hits)
    if not any(w.role == Role.DECODE and not w.hb.draining for w in live):
        assert isinstance(got, Refuse)
        return
    want = reference(live, plen, 16, cfg, hits)
    if want == "refuse":  # no prefill worker (not draining) for a disaggregated plan
        assert isinstance(got, Refuse) and got.code == 503
    elif want == "wait":
        assert isinstance(got, Wait)
    else:
        assert isinstance(got, Plan) and (got.decode, got.prefill) == want
        assert got.kind is (PlanKind.DIRECT if want[1] is None else PlanKind.DISAGGREGATED)
