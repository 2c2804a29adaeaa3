"""Sampling and logprobs between the wire (proto) and the engine: the workers' only conversions."""

from __future__ import annotations

from libs.engine.logits_processors import GuidedSpec
from libs.engine.sampling import SamplingParams, TokenLogprob
from proto import messages as m


def to_params(s: m.Sampling) -> SamplingParams:
    """Wire sampling -> engine SamplingParams (which validates again: ValueError on bad values)."""
    return SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs, top_logprobs=s.top_logprobs, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        logit_bias=tuple(s.logit_bias.items()), min_tokens=s.min_tokens,
        guided=_guided(s.guided),
    )  # fmt: skip


def _guided(g: m.Guided | None) -> GuidedSpec | None:
    return None if g is None else GuidedSpec(g.kind, g.value, tuple(g.start_after))


def to_wire_logprob(lp: TokenLogprob) -> m.TokenLogprob:
    """engine TokenLogprob -> proto TokenLogprob."""
    top = [m.TopLogprob(int(t), float(v)) for t, v in (lp.top or [])]
    return m.TokenLogprob(int(lp.token_id), float(lp.logprob), top)
