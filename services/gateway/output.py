"""One choice's output, assembled from the mesh's TokenDeltas: text, stop strings, logprobs, finish."""

# Pure code. Token ids become text through libs.tokenizer's IncrementalDetokenizer, then pass a
# StopMatcher, so every text returned is final (never retracted): text that might begin a stop string
# is held back until the next delta decides. When a stop string matches, the choice ends there with
# finish_reason "stop" even though the decode worker has not finished: `Step.cancel` tells the caller
# to send a Cancel so the worker stops spending steps on it.

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from libs.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer
from proto.messages import FinishReason, TokenDelta, TokenLogprob
from services.gateway.errors import ApiError
from services.gateway.formatting import LogprobEntry, TopEntry

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-ins byte-level BPE uses for raw bytes."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


class TokenText:
    """A token id's text and raw bytes, as logprobs show them (cached: the same ids recur)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.vocab_size = tok.vocab_size
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        try:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        except ValueError:  # an id of the model's vocab padding, beyond the tokenizer's
            return f"<id:{token_id}>", []
        piece = self._tok.id_to_token(token_id) or ""
        if piece and all(c in _BYTE_DECODER for c in piece):
            # byte-level BPE: the piece spells the token's exact bytes, even half of a UTF-8 character
            return text, [_BYTE_DECODER[c] for c in piece]
        return text, list(text.encode("utf-8"))


@dataclass
class Step:
    """What one delta added to a choice: final text, logprob entries, and the end when reached."""

    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    cancel: bool = False  # ended by a stop string before the worker finished: send Cancel
    tokens: int = 0  # output tokens the delta added (text may be empty: held back, or ids past the tokenizer)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceOutput:
    """Accumulates one choice (for the non-streaming response and the usage counts)."""

    index: int
    tokens: TokenText
    detok: IncrementalDetokenizer
    stop: StopMatcher
    want_logprobs: bool
    tokens_as_ids: bool = False  # logprob entries name tokens "token_id:<id>" instead of their text
    min_tokens: int = 0  # stop strings count only from this many output tokens on (vLLM)
    text: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    _detok_len: int = 0  # characters the detokenizer has produced (text_offset of the next token)

    @classmethod
    def create(
        cls,
        index: int,
        tok: Tokenizer,
        tokens: TokenText,
        prompt_ids: list[int],
        stop: list[str],
        want_logprobs: bool,
        tokens_as_ids: bool = False,
        min_tokens: int = 0,
    ) -> ChoiceOutput:
        detok = IncrementalDetokenizer(tok, prompt_ids)
        return cls(index, tokens, detok, StopMatcher(stop), want_logprobs, tokens_as_ids, min_tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, delta: TokenDelta) -> Step:
        """Apply one delta. Raises ApiError when the mesh ended the request abnormally."""
        step = Step(logprobs=[] if self.want_logprobs else None)
        if self.done:
            return Step()
        for k, token_id in enumerate(delta.token_ids):
            self.completion_tokens += 1
            step.tokens += 1
            offset = self._detok_len
            # A model's vocab may be padded past the tokenizer's; such an id has no text.
            piece = self.detok.add(token_id) if token_id < self.tokens.vocab_size else ""
            self._detok_len += len(piece)
            if step.logprobs is not None:
                lp = delta.logprobs[k] if k < len(delta.logprobs) else TokenLogprob(token_id, 0.0)
                step.logprobs.append(self._entry(lp, offset))
            if self.completion_tokens < self.min_tokens:  # too early for a stop string to count
                emitted, hit = piece, False
            else:
                emitted, hit = self.stop.feed(piece)
            step.text += emitted
            if hit:
                step.finish_reason = "stop"
                step.cancel = delta.finish == FinishReason.NONE  # a finished worker needs no Cancel
                break
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if not step.done and delta.finish != FinishReason.NONE:
            self._finish(delta, step)
        self.text.append(step.text)
        if step.logprobs:
            self.logprobs.extend(step.logprobs)
        self.finish_reason = step.finish_reason
        return step

    def _finish(self, delta: TokenDelta, step: Step) -> None:
        if delta.finish not in _FINISH:
            what = "cancelled" if delta.finish == FinishReason.ABORT else "failed"
            raise ApiError(500, f"the mesh {what} the request", code="internal_error")
        emitted, hit = self.stop.feed(self.detok.flush())
        step.text += emitted if hit else emitted + self.stop.flush()
        step.finish_reason = "stop" if hit else _FINISH[delta.finish]

    def _label(self, token_id: int) -> tuple[str, list[int]]:
        text, raw = self.tokens.lookup(token_id)
        return (f"token_id:{token_id}", raw) if self.tokens_as_ids else (text, raw)

    def _entry(self, lp: TokenLogprob, offset: int) -> LogprobEntry:
        text, raw = self._label(lp.token_id)
        top = []
        for t in lp.top:
            ttext, traw = self._label(t.token_id)
            top.append(TopEntry(ttext, traw, t.logprob))
        return LogprobEntry(text, raw, lp.logprob, top, offset)

    def full_text(self) -> str:
        return "".join(self.text)
