"""When a request ends: stop token ids, EOS (unless ignore_eos), stop strings, max_tokens, checked after every
sampled token in that order (the first three only from min_tokens on, as vLLM's check_stop). Output text is
cut before a stop string; the token that completed it stays in token_ids (as vLLM does)."""

# Stop strings are matched on text from libs.tokenizer's incremental detokenizer and StopMatcher, so one split
# across tokens is found; text produced before min_tokens is never searched.

from __future__ import annotations

from collections.abc import Sequence

from libs.engine.sampling import SamplingParams
from libs.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer


class StopChecker:
    """Finish conditions of one request; feed it every output token in order."""

    def __init__(
        self,
        params: SamplingParams,
        eos_ids: Sequence[int],
        tokenizer: Tokenizer | None,
        prompt_ids: Sequence[int],
    ) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (tokenizer.json in the checkpoint folder)")
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.tokenizer = tokenizer
        self.detok: IncrementalDetokenizer | None = None
        self.matcher: StopMatcher | None = None
        self.text_parts: list[str] = []
        if params.stop and tokenizer is not None:
            self.detok = IncrementalDetokenizer(tokenizer, _in_vocab(prompt_ids, tokenizer))
            self.matcher = StopMatcher(params.stop)

    def check(self, token: int, num_output: int) -> tuple[str | None, int | str | None]:
        """(finish_reason, stop_reason) after `token`, the num_output-th output token; (None, None) to go on."""
        early = num_output < self.params.min_tokens
        if token in self.stop_ids and not early:
            return "stop", token
        if self.detok is not None and self.matcher is not None and self.tokenizer is not None:
            piece = self.detok.add(_in_vocab([token], self.tokenizer))
            emitted, hit = (piece, False) if early else self.matcher.feed(piece)
            self.text_parts.append(emitted)
            if hit:
                return "stop", self.matcher.stop_str
        if num_output >= self.params.max_tokens:
            return "length", None
        return None, None

    def final_text(self, token_ids: Sequence[int], stopped_on_string: bool) -> str | None:
        """The output text: cut before the stop string when one ended the request."""
        if self.tokenizer is None:
            return None
        if self.detok is None or self.matcher is None:
            return self.tokenizer.decode(_in_vocab(token_ids, self.tokenizer))
        if not stopped_on_string:
            emitted, _ = self.matcher.feed(self.detok.flush())
            self.text_parts += [emitted, self.matcher.flush()]
        return "".join(self.text_parts)


def _in_vocab(ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """Ids the tokenizer knows: a model's vocab may be padded past the tokenizer's (never sampled in
    practice, but detokenizing must not fail on them)."""
    n = tokenizer.vocab_size
    return [i for i in ids if 0 <= i < n]
