import random

import pytest

from libs.tokenizer import IncrementalDetokenizer, Tokenizer

FFFD = "\ufffd"
TEXTS = [
    "Hello, world! The quick brown fox.",
    "你好，世界！今天天气很好。龘靐齉 and 🙂🚀👨‍👩‍👧 ❤️",
    "Grüße, Привет, こんにちは 안녕하세요 — “quotes” € ₿ 𝄞",
]


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table, which byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character is split across tokens."""
    symbols = _byte_symbols()
    ids = [tok.token_to_id(symbols[b]) for b in text.encode("utf-8")]
    assert None not in ids
    return ids


def _check_stream(tok: Tokenizer, ids: list[int], steps: list[int]) -> int:
    """Feed ids in chunks of the given sizes (summing to at least len(ids)); check the invariant after each
    chunk; return how many times the full decode so far ended in a partial character."""
    detok = IncrementalDetokenizer(tok)
    held, n, emitted = 0, 0, ""
    for size in steps:
        chunk = ids[n : n + size]
        n += len(chunk)
        emitted += detok.add(chunk)
        full = tok.decode(ids[:n])
        assert full.startswith(emitted)
        if full.endswith(FFFD):
            held += 1
        else:
            assert emitted == full  # nothing certain is ever held back
    assert n == len(ids)
    emitted += detok.flush()
    assert emitted == detok.text == tok.decode(ids)
    return held


@pytest.mark.parametrize("text", TEXTS)
def test_equals_full_decode_at_every_prefix(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    _check_stream(tok, ids, [1] * len(ids))
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[1:])
def test_split_multibyte_characters_are_held_back(tok: Tokenizer, text: str) -> None:
    ids = _byte_token_ids(tok, text)
    assert tok.decode(ids) == text
    held = _check_stream(tok, ids, [1] * len(ids))
    assert held > 0  # the hold-back path really ran
    rng = random.Random(0)
    _check_stream(tok, ids, [rng.randint(1, 4) for _ in ids])


def test_one_emoji_byte_by_byte(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in _byte_token_ids(tok, "🙂")]
    assert deltas == ["", "", "", "🙂"]


def test_flush_releases_incomplete_bytes(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    a_and_half_emoji = _byte_token_ids(tok, "a🙂")[:3]
    assert detok.add(a_and_half_emoji) == ""  # "a" waits with the partial character (one window, as vLLM)
    assert detok.flush() == "a" + FFFD
    assert detok.flush() == ""


def test_random_token_streams(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        _check_stream(tok, ids, [rng.randint(1, 3) for _ in ids])


def test_prompt_context_and_special_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    out = tok.encode(" Hello 世界", add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in out) + detok.flush()
    assert text == " Hello 世界"  # the prompt is context only; EOS is skipped
    assert detok.token_ids == out
    keep = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
    assert keep.add(out) == " Hello 世界<｜end▁of▁sentence｜>"
    assert IncrementalDetokenizer(tok).add([]) == ""


def test_ids_past_the_tokenizer_vocab_decode_to_nothing(tok: Tokenizer) -> None:
    # a model's vocab may be padded past the tokenizer's; a stream must not fail on such an id
    detok = IncrementalDetokenizer(tok, prompt_ids=[tok.vocab_size + 7, *tok.encode("Hi")])
    hello = tok.encode(" hello", add_special_tokens=False)
    assert detok.add(tok.vocab_size) == ""
    assert "".join(detok.add(i) for i in hello) == " hello"
    assert detok.token_ids == [tok.vocab_size, *hello]
