"""bench.part_timer on the tiny model on the CPU: a prefill step's MLA blocks, their attention kernel and
the MoE blocks are each timed (nested parts within their block, both within the step), and leaving the
timer puts the engine's functions back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_a_prefill_step_is_broken_down_by_part(tmp_path) -> None:
    from bench import part_timer
    from libs.engine import Engine
    from libs.engine.layers import fast_path
    from libs.engine.models import deepseek_v3
    from libs.engine.sampling import SamplingParams
    from libs.engine.tiny import write_tiny_model

    engine = Engine.from_pretrained(str(write_tiny_model(tmp_path / "tiny", seed=0)), device="cpu")
    engine.add_request("a", list(range(3, 200)), SamplingParams(temperature=0.0, max_tokens=1))
    before = (fast_path.attention, fast_path.moe, deepseek_v3.Attention.forward, deepseek_v3.MoE.forward)
    rec = part_timer.breakdown(engine.step, cuda=False)
    assert 0 < rec["attention_kernel_ms"] < rec["attention_ms"]
    assert rec["moe_ms"] > 0 and rec["other_ms"] > 0
    assert rec["attention_ms"] + rec["moe_ms"] < rec["step_ms"]
    assert rec["attention_share"] + rec["moe_share"] + rec["other_share"] == pytest.approx(1.0)
    assert (fast_path.attention, fast_path.moe, deepseek_v3.Attention.forward, deepseek_v3.MoE.forward) == before
    assert not engine.has_unfinished()  # the step ran: the prompt prefilled and its one token sampled
