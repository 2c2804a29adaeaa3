"""MTP speculative decoding over an EP group (EPEngine(mtp_k=k)): every rank runs an MTPEngine whose MTP
module is whole and local, while the target's MoE layers keep their lockstep rounds (ranks run different
numbers of forwards per step: prefill + verify on one, verify alone or nothing on another). Greedy
tokens equal the single-rank plain engine's, on a tiny random config and on a briefly trained demo-recipe
model (drafts accepted), through generate and the PD hooks; drafted/accepted add up over ranks in stats
and metrics; no page leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.ep.engine import EPEngine

PAGES = 48  # per rank
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 40, 41], list(range(100, 137)), [300], list(range(50, 70))]


def _no_leak(ep: EPEngine) -> None:
    ep.flush_prefix_cache()
    stats = ep.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["running"] == 0, stats


def test_ep_mtp_greedy_equals_the_single_rank_plain_engine(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny", seed=3, num_nextn_predict_layers=1)
    want = [o.token_ids for o in Engine.from_pretrained(path, num_pages=PAGES).generate(PROMPTS, GREEDY)]
    with EPEngine(str(path), ep_size=2, num_pages=PAGES, max_prefill_tokens=16, mtp_k=2) as ep:
        assert [o.token_ids for o in ep.generate(PROMPTS, GREEDY)] == want
        stats = ep.stats()
        assert stats["mtp_drafted"] > 0 and 0 <= stats["mtp_accepted"] <= stats["mtp_drafted"]
        _no_leak(ep)


def test_ep_mtp_on_a_trained_model_accepts_drafts_and_drafts_after_pd(tmp_path: Path) -> None:
    from libs.demo.train import build_demo_model, quick_settings

    path = build_demo_model(
        tmp_path / "demo", quick_settings(steps=60, batch_size=4, seq_len=64), log=lambda _: None
    )
    ref = Engine.from_pretrained(path)
    assert ref.tokenizer is not None
    prompts = [
        ref.tokenizer.encode(t) for t in ("A list is", "The import statement", "class", "Dictionaries")
    ]
    want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    with EPEngine(str(path), ep_size=2, num_pages=PAGES, mtp_k=2) as ep:
        assert [o.token_ids for o in ep.generate(prompts, GREEDY)] == want
        registry = CollectorRegistry()
        ep.register_metrics(registry)
        accepted = registry.get_sample_value("moemesh_mtp_accepted_tokens_total")
        assert accepted is not None and accepted > 0
        assert registry.get_sample_value("moemesh_mtp_drafted_tokens_total") == ep.stats()["mtp_drafted"]
        # PD: prefill on one rank, its pages copied into pages reserved on (maybe) another, decode there:
        # that rank's MTP module has no rows for the prompt, so its first drafts are worse, never wrong
        p = prompts[1]
        res = ep.prefill("pd-src", p, GREEDY)
        dst = ep.reserve("pd-dst", len(p))
        buf = ep.kv_pool.buffer.view(ep.config.num_hidden_layers, -1, ep.page_size, ep.config.kv_row_dim)
        buf[:, dst[: len(res.page_ids)]] = buf[:, res.page_ids]  # what the Mooncake write does
        assert ep.release("pd-src")
        drafted = ep.stats()["mtp_drafted"]
        ep.add_prefilled("pd-dst", p, res.first_token, GREEDY)
        tokens = [res.first_token]
        while ep.has_unfinished():
            tokens += [t for o in ep.step() for t in o.token_ids]
        assert tokens == want[1]
        assert ep.stats()["mtp_drafted"] > drafted
        _no_leak(ep)


def test_ep_mtp_needs_an_mtp_layer(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "no-mtp", seed=0)
    with pytest.raises(ValueError, match="MTP layer"):
        EPEngine(str(path), ep_size=2, mtp_k=2)
