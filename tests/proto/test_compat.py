"""Array-like messages stay readable across versions: fields are only appended after `v`, so a reader
of the older layout decodes the newer one (trailing fields ignored) and vice versa (defaults filled)."""

from __future__ import annotations

import msgspec

import proto
from proto import messages as m


class _OldTokenBatch(m.Kind, frozen=True, array_like=True, omit_defaults=True, gc=False, tag="TokenBatch"):
    deltas: list[m.TokenDelta]


class _OldRequestError(m.Kind, frozen=True, array_like=True, tag="RequestError"):
    request_id: str
    code: int
    message: str


class _OldTokenDelta(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    token_ids: list[int]
    logprobs: list[m.TokenLogprob] = []
    finish: m.FinishReason = m.FinishReason.NONE
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def test_token_batch_layout_is_append_only() -> None:
    new = m.TokenBatch(deltas=[m.TokenDelta("r1", [5, 6], offset=2)], worker_id="d0")
    old = msgspec.msgpack.decode(proto.encode(new), type=_OldTokenBatch)
    assert old.deltas[0].token_ids == [5, 6] and old.v == m.SCHEMA_VERSION
    back = proto.decoder(m.StreamMessage).decode(proto.encode(_OldTokenBatch(deltas=new.deltas)))
    assert isinstance(back, m.TokenBatch) and back.worker_id == "" and back.deltas == new.deltas


def test_request_error_layout_is_append_only() -> None:
    new = m.RequestError(request_id="r1", code=503, message="gone", worker_id="p1")
    old = msgspec.msgpack.decode(proto.encode(new), type=_OldRequestError)
    assert (old.request_id, old.code, old.message) == ("r1", 503, "gone")
    back = proto.decoder(m.StreamMessage).decode(
        proto.encode(_OldRequestError(request_id="r1", code=5, message="x"))
    )
    assert isinstance(back, m.RequestError) and back.worker_id == "" and back.code == 5


def test_token_delta_offset_is_appended() -> None:
    new = m.TokenDelta("r1", [1], offset=7)
    old = msgspec.msgpack.decode(proto.encode(new), type=_OldTokenDelta)
    assert old.token_ids == [1]
    back = msgspec.msgpack.decode(proto.encode(_OldTokenDelta("r1", [1])), type=m.TokenDelta)
    assert back.offset == -1  # not given: the receiver skips its gap check
