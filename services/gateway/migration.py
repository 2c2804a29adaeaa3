"""Request migration at the gateway (Dynamo-style), as pure bookkeeping for one choice."""

# The gateway is the one place that knows what the client already received, so it drives migration: a
# choice that loses its holder (decode worker or scheduler replica dead, or a retryable RequestError:
# code 503) is re-submitted under a new mesh request id as prompt + every token already streamed, with
# max_tokens reduced by as many, and the client's stream simply continues. With greedy sampling the
# continuation equals an undisturbed run. At most `max_migrations` times; then the error ends the stream.
#
# Deltas carry `offset` (index of their first token in the current attempt's output): a repeated delta is
# trimmed, a gap (a lost message) forces a migration from the tokens held, so the client never sees a
# token twice or misses one. Deltas of an attempt that is no longer current are ignored by the caller.

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from proto.messages import FinishReason, Sampling, Submit, TokenDelta

RETRYABLE = frozenset({503})


class TokenGap(Exception):
    """A delta starts past the tokens received: a message was lost."""


@dataclass
class ChoiceRun:
    """One choice's mesh attempts: the current request id, the tokens streamed so far, what to avoid."""

    base_id: str
    prompt_ids: list[int]
    sampling: Sampling
    max_migrations: int
    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    migrations: int = 0
    avoid: list[str] = field(default_factory=list)
    tries: int = 0  # submits of the current attempt (a refused re-submit is tried again, renamed)
    _attempt_start: int = 0  # len(tokens) when the current attempt began

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        self.rid = self.rid or self.base_id

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.tokens)

    def accept(self, delta: TokenDelta) -> TokenDelta | None:
        """The part of `delta` not seen yet (None when nothing is new); TokenGap when tokens were lost."""
        if delta.offset >= 0:
            have = len(self.tokens) - self._attempt_start
            if delta.offset > have:
                raise TokenGap(f"{self.rid}: delta at token {delta.offset}, {have} received")
            skip = have - delta.offset
            if skip:
                if skip >= len(delta.token_ids) and delta.finish == FinishReason.NONE:
                    return None
                delta = msgspec.structs.replace(
                    delta, token_ids=delta.token_ids[skip:], logprobs=delta.logprobs[skip:], offset=have
                )
        if self.migrations and delta.cached_tokens > len(self.prompt_ids):
            # a re-submitted prompt holds generated tokens too; usage counts the client's prompt only
            delta = msgspec.structs.replace(delta, cached_tokens=len(self.prompt_ids))
        self.tokens.extend(delta.token_ids)
        return delta

    def can_migrate(self, code: int) -> bool:
        return code in RETRYABLE and self.migrations < self.max_migrations

    def next_submit(self, model: str, stream_subject: str, arrival_ms: int, lost: str = "") -> Submit:
        """Start the next attempt: a new request id, prompt + tokens so far, the rest of max_tokens."""
        if self.remaining < 1:
            raise ValueError(f"{self.base_id}: nothing left to generate")
        self.migrations += 1
        if lost and lost not in self.avoid:
            self.avoid.append(lost)
        self.rid, self.tries = f"{self.base_id}-m{self.migrations}", 0
        self._attempt_start = len(self.tokens)
        return Submit(
            request_id=self.rid, model=model, prompt_ids=self.prompt_ids + self.tokens,
            sampling=msgspec.structs.replace(self.sampling, max_tokens=self.remaining),
            stream_subject=stream_subject, arrival_ms=arrival_ms, avoid=list(self.avoid),
        )  # fmt: skip

    def renew(self, sub: Submit) -> Submit:
        """The same attempt under a fresh request id, for submitting again after a refusal or timeout
        (a Cancel sent for the old id must not reach the new submit)."""
        self.tries += 1
        self.rid = f"{self.base_id}-m{self.migrations}t{self.tries}"
        return msgspec.structs.replace(sub, request_id=self.rid)
