"""Streaming detokenization: text deltas from token ids, as vLLM's detokenize_incrementally does."""

# Decoding token by token is wrong twice over: byte-level tokens can end inside a multi-byte UTF-8
# character (decoding alone gives U+FFFD), and sentencepiece-style decoders change a token's text by
# what precedes it (leading spaces). So each step decodes a short window of tokens twice, from
# `prefix_offset` to `read_offset` (text already emitted) and from `prefix_offset` to the end, and
# emits the difference. A delta ending in U+FFFD is held back until the character completes, so the
# concatenated deltas always equal a full decode of every token so far, minus a trailing partial
# character; `flush()` releases what is still held (a genuinely invalid byte sequence) at the end.
# Cost per step is bounded by the window, not by the length of the output.
#
# Ids the tokenizer does not know decode to nothing (a model's vocab may be padded past the tokenizer's,
# as DeepSeek-V3's is), so a stream never fails halfway; `Tokenizer.decode` itself stays strict.

from __future__ import annotations

from collections.abc import Iterable, Sequence

from libs.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens of prompt context decoded with the first output tokens, so the first delta gets the
# same leading-space treatment as in a full decode (vLLM uses 5 too).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas; one instance per request."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._vocab_size = tokenizer.vocab_size
        self._ids: list[int] = self._known(prompt_ids)[-_PROMPT_CONTEXT:]
        self._output_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The output token ids added so far (not the prompt)."""
        return list(self._output_ids)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        return "".join(self._text)

    def add(self, token_ids: Iterable[int] | int) -> str:
        """Append output token ids (one or several); return the new text that is now certain ("" if none)."""
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._output_ids.extend(new)
        known = self._known(new)
        if not known:
            return ""
        self._ids.extend(known)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or the last character is still incomplete
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the request: emit what is still held back (U+FFFD for bytes that never completed)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode_known(self._ids[start:end], skip_special_tokens=self._skip)

    def _known(self, ids: Iterable[int]) -> list[int]:
        return [i for i in ids if 0 <= i < self._vocab_size]
