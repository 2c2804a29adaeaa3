import random

import pytest

from libs.tokenizer import StopMatcher


def test_stop_inside_one_delta() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("Hello STOP world") == ("Hello ", True)
    assert (m.stopped, m.stop_str) == (True, "STOP")
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_partial_match_is_held_then_completed() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("Hello ST") == ("Hello ", False)
    assert m.held == "ST"
    assert m.feed("OP and more") == ("", True)


def test_partial_match_is_released_when_it_breaks() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("Hello ST") == ("Hello ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"  # end of stream for another reason: nothing is lost


def test_include_stop_string() -> None:
    m = StopMatcher(["</end>"], include_stop_str=True)
    assert m.feed("done </e") == ("done ", False)
    assert m.feed("nd> tail") == ("</end>", True)


def test_earliest_match_wins_then_longest() -> None:
    assert StopMatcher(["world", "lo"]).feed("hello world") == ("hel", True)
    m = StopMatcher(["ab", "abc"])
    assert m.feed("xabcd") == ("x", True) and m.stop_str == "abc"


def test_self_overlapping_stop_char_by_char() -> None:
    m = StopMatcher(["aab"])
    out = [m.feed(c) for c in "aaab"]
    assert out == [("", False), ("", False), ("a", False), ("", True)]


def test_no_stops_pass_through_and_bad_stops() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_random_streams_match_reference() -> None:
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        m, emitted, stopped, pos = StopMatcher(stops), "", False, 0
        want, want_stop = _reference(text, stops)
        while pos < len(text) and not stopped:
            step = rng.randint(1, 5)
            out, stopped = m.feed(text[pos : pos + step])
            pos += step
            emitted += out
            assert want.startswith(emitted)  # never emits past the stop
        if not stopped:
            emitted += m.flush()
        assert (emitted, stopped) == (want, want_stop), (text, stops)
