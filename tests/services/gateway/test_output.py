"""One choice's assembly from TokenDeltas: detokenization, stop strings, logprobs, finish."""

from __future__ import annotations

import pytest

from libs.tokenizer import Tokenizer
from proto.messages import FinishReason, TokenDelta, TokenLogprob, TopLogprob
from services.gateway.errors import ApiError
from services.gateway.output import ChoiceOutput, TokenText

TEXT = " The model reads a prompt, 日本語 ok."


def make(tokenizer: Tokenizer, stop: list[str] = (), logprobs: bool = False) -> ChoiceOutput:  # type: ignore[assignment]
    return ChoiceOutput.create(
        0, tokenizer, TokenText(tokenizer), tokenizer.encode("hi"), list(stop), logprobs
    )


def deltas(ids: list[int], per: int = 1, finish: FinishReason = FinishReason.LENGTH, lp: bool = False):
    """Deltas of `per` tokens; the last one carries `finish`."""
    out = []
    for i in range(0, len(ids), per):
        chunk = ids[i : i + per]
        last = i + per >= len(ids)
        lps = (
            [TokenLogprob(t, -0.5 * (i + j), [TopLogprob(t, -0.5 * (i + j))]) for j, t in enumerate(chunk)]
            if lp
            else []
        )
        out.append(TokenDelta("r", chunk, lps, finish=finish if last else FinishReason.NONE))
    return out


@pytest.mark.parametrize("per", [1, 3, 100])
def test_text_equals_full_decode_however_coalesced(tokenizer: Tokenizer, per: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = make(tokenizer)
    texts = [out.feed(d).text for d in deltas(ids, per)]
    assert "".join(texts) == out.full_text() == tokenizer.decode(ids)
    assert out.finish_reason == "length" and out.completion_tokens == len(ids)
    assert all("\ufffd" not in t for t in texts)  # split characters are held, never emitted broken


def test_eos_is_not_rendered_and_finishes_with_stop(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" ok", add_special_tokens=False) + [tokenizer.eos_token_id]
    out = make(tokenizer)
    for d in deltas(ids, 1, FinishReason.STOP):
        out.feed(d)
    assert out.full_text() == " ok" and out.finish_reason == "stop"


def test_stop_string_across_deltas_truncates_and_asks_for_cancel(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = make(tokenizer, stop=["reads a"])
    steps = []
    for d in deltas(ids, 1):
        steps.append(out.feed(d))
        if out.done:
            break
    assert out.full_text() == " The model "
    last = steps[-1]
    assert last.finish_reason == "stop" and last.cancel  # the worker is still going: cancel it
    consumed = len(steps)
    assert out.completion_tokens == consumed < len(ids)
    assert tokenizer.decode(ids[:consumed]).startswith(" The model reads a")
    assert out.feed(TokenDelta("r", ids[consumed:])).text == ""  # later deltas change nothing


def test_stop_strings_count_only_from_min_tokens(tokenizer: Tokenizer) -> None:
    (a,) = tokenizer.encode(" a", add_special_tokens=False)
    (b,) = tokenizer.encode(" b", add_special_tokens=False)
    out = ChoiceOutput.create(0, tokenizer, TokenText(tokenizer), [1], ["a"], False, min_tokens=3)
    for d in deltas([a, b, a, b, a, b], 2):
        out.feed(d)
        if out.done:
            break
    # token 1's "a" is before min_tokens; token 3's stops the choice
    assert out.full_text() == " a b " and out.finish_reason == "stop" and out.completion_tokens == 3


def test_stop_string_in_the_final_delta_needs_no_cancel(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = make(tokenizer, stop=["ok."])
    (step,) = [out.feed(d) for d in deltas(ids, len(ids))]
    assert step.finish_reason == "stop" and not step.cancel
    assert out.full_text() == TEXT[: TEXT.index("ok.")]


def test_held_back_stop_prefix_is_released_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = make(tokenizer, stop=["k.X"])
    for d in deltas(ids, 2):
        out.feed(d)
    assert out.full_text() == TEXT and out.finish_reason == "length"


def test_logprob_entries_bytes_and_offsets(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = make(tokenizer, logprobs=True)
    for d in deltas(ids, 2, lp=True):
        out.feed(d)
    entries = out.logprobs
    assert len(entries) == len(ids)
    assert b"".join(bytes(e.bytes) for e in entries) == TEXT.encode()  # exact bytes, even of split characters
    assert [e.logprob for e in entries] == [-0.5 * k for k in range(len(ids))]
    assert all(e.top[0].token == e.token for e in entries)
    offsets = [e.offset for e in entries]
    assert offsets == sorted(offsets) and offsets[0] == 0
    for e, nxt in zip(entries, entries[1:], strict=False):
        if "\ufffd" not in e.token and nxt.offset > e.offset:
            assert TEXT[e.offset : nxt.offset] == e.token


def test_tokens_as_ids_name_every_token_and_top_entry_by_id(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = ChoiceOutput.create(0, tokenizer, TokenText(tokenizer), [], [], True, tokens_as_ids=True)
    for d in deltas(ids, 3, lp=True):
        out.feed(d)
    assert [e.token for e in out.logprobs] == [f"token_id:{t}" for t in ids]
    assert all(e.top[0].token == e.token for e in out.logprobs)
    assert out.full_text() == TEXT  # the text itself is unchanged


def test_special_token_text_in_logprobs(tokenizer: Tokenizer) -> None:
    text, raw = TokenText(tokenizer).lookup(tokenizer.eos_token_id)
    assert text == tokenizer.eos_token and bytes(raw).decode() == text


def test_ids_past_the_tokenizer_vocab_have_no_text(tokenizer: Tokenizer) -> None:
    ok = tokenizer.encode(" ok", add_special_tokens=False)
    out = make(tokenizer, logprobs=True)
    out.feed(TokenDelta("r", [tokenizer.vocab_size + 3], [TokenLogprob(tokenizer.vocab_size + 3, -1.0)]))
    out.feed(TokenDelta("r", ok, finish=FinishReason.LENGTH))
    assert out.full_text() == " ok" and out.completion_tokens == 1 + len(ok)
    assert out.logprobs[0].token == f"<id:{tokenizer.vocab_size + 3}>"


@pytest.mark.parametrize("finish", [FinishReason.ABORT, FinishReason.ERROR])
def test_abnormal_finish_is_an_error(tokenizer: Tokenizer, finish: FinishReason) -> None:
    out = make(tokenizer)
    with pytest.raises(ApiError) as e:
        out.feed(TokenDelta("r", [5], finish=finish))
    assert e.value.status == 500
