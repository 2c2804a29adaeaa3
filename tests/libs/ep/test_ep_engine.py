"""EPEngine with 2 and 4 rank processes (gloo on CPU) against the single-rank Engine on the same checkpoint:
ragged prefill logits, greedy tokens, redundant experts, a rebalance in the middle of generation, the PD
hooks over the shared KV pool, and errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.engine import Engine, SamplingParams
from libs.engine.logits_processors import GuidedSpec
from libs.engine.tiny import write_tiny_model
from libs.ep.engine import EPEngine
from tests.libs.cache_recorder import Recorder

PAGES = 48  # per rank
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ep") / "tiny", seed=0)


@pytest.fixture(scope="module")
def ref(tiny: Path) -> Engine:
    return Engine.from_pretrained(tiny, num_pages=PAGES, max_prefill_tokens=32)


@pytest.fixture(
    scope="module", params=[(2, 0, "torch"), (4, 4, "torch"), (2, 2, "fixed")],
    ids=["ep2", "ep4-redundant4", "ep2-redundant2-fixed"],
)  # fmt: skip
def group(request: pytest.FixtureRequest, tiny: Path) -> Iterator[EPEngine]:
    """fixed: buffers for max_num_seqs=4 tokens per rank, so decode rounds take them and longer prefill
    forwards its all-to-all fallback."""
    ranks, redundant, backend = request.param
    seqs = {"max_num_seqs": 4} if backend == "fixed" else {}
    with EPEngine(
        str(tiny), ep_size=ranks, num_pages=PAGES, max_prefill_tokens=32, ep_redundant_experts=redundant, ep_backend=backend,
        **seqs,
    ) as ep:  # fmt: skip
        yield ep


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 1000 + 3 for i in range(n)]


RAGGED = [prompt(n, n) for n in (1, 45, 9, 20, 3)]


def test_ragged_prefill_logits_equal_the_single_rank_engine(group: EPEngine, ref: Engine) -> None:
    for p, got in zip(RAGGED, group.prefill_logits_many(RAGGED), strict=True):
        torch.testing.assert_close(got, ref.prefill_logits(p), atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_the_single_rank_engine(group: EPEngine, ref: Engine) -> None:
    want = [o.token_ids for o in ref.generate(RAGGED, GREEDY)]
    assert [o.token_ids for o in group.generate(RAGGED, GREEDY)] == want


def test_penalties_bias_and_grammar_equal_the_single_rank_engine(group: EPEngine, ref: Engine) -> None:
    """Logits processing runs inside each rank's engine: the same tokens as one engine."""
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                       logit_bias={7: 3.0}, min_tokens=8),
        SamplingParams(max_tokens=12, temperature=1.0, seed=4, guided=GuidedSpec("regex", "[a-c]{2}-[0-9]{2}")),
    ]  # fmt: skip
    prompts = RAGGED[1:3]
    want = [o.token_ids for o in ref.generate(prompts, params)]
    assert [o.token_ids for o in group.generate(prompts, params)] == want


def test_rebalance_in_the_middle_of_generation_keeps_every_request_exact(
    group: EPEngine, ref: Engine
) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = {f"r{i}": o.token_ids for i, o in enumerate(ref.generate(RAGGED, params))}
    for rid, p in zip(want, RAGGED, strict=True):
        group.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in want}
    for _ in range(4):
        for o in group.step():
            got[o.rid] += o.token_ids
    before, rebalances = group.placement, group.num_rebalances
    assert group.window_load.sum() > 0
    new = group.rebalance()  # EPLB from the load measured so far; weights move between ranks
    assert new != before and group.num_rebalances == rebalances + 1 and group.placement == new
    assert group.has_unfinished()
    while group.has_unfinished():
        for o in group.step():
            got[o.rid] += o.token_ids
    assert got == want
    assert not group.owner


def test_pd_hooks_move_kv_through_the_shared_pool(group: EPEngine, ref: Engine) -> None:
    """prefill on one rank, copy its pages into pages reserved (maybe on another rank), decode there."""
    p = prompt(37, 11)
    want = ref.generate([p], GREEDY)[0].token_ids
    res = group.prefill("pd-src", p, GREEDY)
    dst = group.reserve("pd-dst", len(p))
    buf = group.kv_pool.buffer.view(
        group.config.num_hidden_layers, -1, group.page_size, group.config.kv_row_dim
    )
    buf[:, dst[: len(res.page_ids)]] = buf[:, res.page_ids]  # what the Mooncake write does between workers
    assert group.release("pd-src")
    group.add_prefilled("pd-dst", p, res.first_token, GREEDY)
    tokens = [res.first_token]
    while group.has_unfinished():
        tokens += [t for o in group.step() for t in o.token_ids]
    assert tokens == want


def test_batched_prefill_over_ranks_gives_single_prefill_tokens_and_kv(group: EPEngine, ref: Engine) -> None:
    """add_prefill + step across the ranks: global page ids whose rows equal the single engine's prefill."""
    prompts = {f"bp{i}": prompt(n, 50 + n) for i, n in enumerate((40, 7, 23, 33))}
    for rid, p in prompts.items():
        group.add_prefill(rid, p, GREEDY)
    got = {}
    while group.has_unfinished():
        got |= {o.rid: o.prefill for o in group.step() if o.prefill is not None}
    assert got.keys() == prompts.keys()
    ps, layers = group.page_size, group.config.num_hidden_layers

    def rows(buffer: torch.Tensor, pages: list[int], n: int) -> torch.Tensor:
        idx = torch.cat([torch.arange(q * ps, (q + 1) * ps) for q in pages])[:n]
        return buffer.view(layers, -1, buffer.shape[-1])[:, idx].clone()

    for rid, p in prompts.items():
        want = ref.prefill(rid, p, GREEDY)
        assert got[rid].first_token == want.first_token, rid
        torch.testing.assert_close(
            rows(group.kv_pool.buffer, got[rid].page_ids, len(p)),
            rows(ref.kv_pool.buffer, want.page_ids, len(p)), rtol=0, atol=1e-4,
        )  # fmt: skip
        ref.release(rid)
        assert group.release(rid)
    assert group.stats()["pinned"] == 0


def test_bad_requests_are_value_errors_and_the_group_keeps_serving(group: EPEngine, ref: Engine) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        group.add_request("bad", [10**6], GREEDY)
    group.add_request("dup", prompt(4), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        group.add_request("dup", prompt(4), GREEDY)
    assert group.abort("dup") and not group.abort("dup")
    with pytest.raises(ValueError, match="no reservation"):
        group.add_prefilled("nope", prompt(3), 5, GREEDY)
    assert group.generate([prompt(5)], GREEDY)[0].token_ids == ref.generate([prompt(5)], GREEDY)[0].token_ids


def test_expert_load_and_stats_add_up_over_ranks(group: EPEngine, request: pytest.FixtureRequest) -> None:
    before = group.expert_load.sum()
    group.prefill_logits(prompt(10))
    k = group.config.num_experts_per_tok
    assert group.expert_load.sum() - before == 10 * k * len(group.layer_ids)
    st = group.stats()
    assert st["total_pages"] == PAGES * group.ep_size and st["running"] == 0
    per_rank = 4 if request.node.callspec.params["group"][2] == "fixed" else 64  # the fixture's max_num_seqs
    assert st["max_running"] == per_rank * group.ep_size  # the group's batch: what its heartbeat says


def test_bad_settings_are_refused_before_any_process_starts(tiny: Path) -> None:
    with pytest.raises(ValueError, match="do not divide over 4 EP ranks"):
        EPEngine(str(tiny), ep_size=4, ep_redundant_experts=2)
    with pytest.raises(ValueError, match="ep_backend must be one of"):
        EPEngine(str(tiny), ep_size=2, ep_backend="nvshmem")


def test_a_request_goes_to_the_rank_that_caches_its_prefix(group: EPEngine) -> None:
    shared = prompt(40, 99)  # two full 16-token pages of shared prefix
    recorder = Recorder()
    group.set_cache_listener(recorder)
    group.add_request("first", shared, GREEDY)
    first_rank = group.owner["first"]
    while group.has_unfinished():
        group.step()
    first_rank_blocks = [b for kind, hs in recorder.events if kind == "stored" for b in hs]
    assert len(first_rank_blocks) >= 2
    # make the caching rank the busier one: without prefix affinity "second" would go elsewhere
    group.add_request("filler", prompt(5, 1), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert group.owner["filler"] == first_rank  # ties go to the lowest rank, as they did for "first"
    group.add_request("second", shared[:33] + [5, 6], GREEDY)
    assert group.owner["second"] == first_rank
    cached = None
    while group.has_unfinished():
        for o in group.step():
            cached = o.cached_tokens if o.rid == "second" else cached
    assert cached == 32
    group.set_cache_listener(None)
