"""Turning engine step outputs into wire messages: one TokenBatch per (decode step, gateway)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from libs.engine.outputs import StepOutput
from libs.worker.wire import to_wire_logprob
from proto import messages as m

FINISH = {"stop": m.FinishReason.STOP, "length": m.FinishReason.LENGTH, "abort": m.FinishReason.ABORT}


@dataclass
class Live:
    """What the decode worker remembers of a request it streams."""

    stream_subject: str
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0


def delta_of(out: StepOutput, live: Live) -> m.TokenDelta:
    """cached_tokens: the prefill side's (PD, in Live) or the engine's own prefix hit (direct, in out)."""
    offset = live.completion_tokens  # tokens this request streamed before: the gateway's gap check
    live.completion_tokens += len(out.token_ids)
    lps = [to_wire_logprob(lp) for lp in out.logprobs] if out.logprobs else []
    if not out.finished:
        return m.TokenDelta(out.rid, list(out.token_ids), lps, offset=offset)
    return m.TokenDelta(
        out.rid, list(out.token_ids), lps, FINISH.get(out.finish_reason or "stop", m.FinishReason.STOP),
        live.prompt_tokens, live.completion_tokens, max(live.cached_tokens, out.cached_tokens), offset=offset,
    )  # fmt: skip


def group_by_stream(outputs: Iterable[StepOutput], live: dict[str, Live]) -> dict[str, list[m.TokenDelta]]:
    """Deltas per gateway stream subject; outputs of requests no longer live (cancelled) are dropped."""
    batches: dict[str, list[m.TokenDelta]] = defaultdict(list)
    for out in outputs:
        lv = live.get(out.rid)
        if lv is None:
            continue
        batches[lv.stream_subject].append(delta_of(out, lv))
    return batches
