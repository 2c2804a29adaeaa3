"""Request bodies and SSE chunk parsing (pure); the slow-down release policy."""

from __future__ import annotations

import pytest

from libs.loadgen.client import Endpoint, parse_chunk, record_chunk, request_body
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.slowdown import SlowdownConfig, release_reason
from libs.loadgen.stats import RequestRecord


def test_completion_body_streams_with_usage_and_holds_the_output_length() -> None:
    ep = Endpoint("http://h:1", model="m", extra_body={"top_k": 5})
    body = request_body(ep, BenchRequest([4, 5, 6], 3, 7))
    assert ep.url == "http://h:1/v1/completions"
    assert body == {
        "model": "m", "prompt": [4, 5, 6], "max_tokens": 7, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 5,
    }  # fmt: skip


def test_chat_body_sends_text_and_asks_logprobs_when_counting_chunks() -> None:
    ep = Endpoint("http://h:1/", backend="openai-chat", model="m", api_key="k", chunk_logprobs=True)
    body = request_body(ep, BenchRequest("hi", 1, 3))
    assert ep.url == "http://h:1/v1/chat/completions"
    assert ep.headers() == {"Authorization": "Bearer k"}
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["logprobs"] is True
    with pytest.raises(ValueError, match="text prompts"):
        request_body(ep, BenchRequest([1], 1, 3))
    assert request_body(Endpoint("http://h", chunk_logprobs=True), BenchRequest([1], 1, 3))["logprobs"] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"), [(dict(backend="vllm"), "backend"), (dict(base_url="h:1"), "http")]
)
def test_bad_endpoints_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Endpoint(**({"base_url": "http://h"} | kwargs))


def test_chunks_count_tokens_from_logprobs_or_one_per_text() -> None:
    text = {"choices": [{"index": 0, "text": " the", "logprobs": None}], "usage": None}
    assert parse_chunk(text, chat=False).tokens == 1
    empty = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    assert parse_chunk(empty, chat=False).tokens == 0
    named = {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1, -2]}}]}
    assert parse_chunk(named, chat=False).tokens == 2
    unnamed = {"choices": [{"text": "", "logprobs": {"tokens": ["\ufffd"]}}]}  # no text, still a token
    assert parse_chunk(unnamed, chat=False).tokens == 1


def test_chat_chunks_role_delta_content_and_usage() -> None:
    assert parse_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True).tokens == 0
    assert parse_chunk({"choices": [{"delta": {"content": "x"}}]}, chat=True).tokens == 1
    lp = {
        "choices": [{"delta": {"content": "xy"}, "logprobs": {"content": [{"token": "x"}, {"token": "y"}]}}]
    }
    assert parse_chunk(lp, chat=True).tokens == 2
    usage = parse_chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, chat=True)
    assert (usage.tokens, usage.usage) == (0, {"prompt_tokens": 3, "completion_tokens": 4})


def test_continuous_usage_counts_each_chunk_by_the_servers_count_so_far() -> None:
    body = request_body(Endpoint("http://h", chunk_usage=True), BenchRequest([1], 1, 3))
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "logprobs" not in body
    rec = RequestRecord(index=0, start=0.0)

    def chunk(text: str, so_far: int) -> dict:
        return {"choices": [{"text": text}], "usage": {"prompt_tokens": 2, "completion_tokens": so_far}}

    events = [
        chunk("", 0),  # nothing generated yet (a chat stream's role chunk)
        chunk("ab", 2),  # a token whose text was held back (an incomplete UTF-8 sequence) and the next one
        chunk("c", 3),
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},  # the final usage chunk
    ]
    for t, e in enumerate(events):
        record_chunk(rec, parse_chunk(e, chat=False), float(t))
    assert (rec.chunk_times, rec.chunk_tokens) == ([1.0, 2.0], [2, 1])
    plain = RequestRecord(index=1, start=0.0)  # without the server's count: 1 per chunk with text
    for t, e in enumerate(events):
        record_chunk(plain, parse_chunk({k: v for k, v in e.items() if k != "usage"}, chat=False), float(t))
    assert plain.chunk_tokens == [1, 1]


def test_error_events_are_reported() -> None:
    assert parse_chunk({"error": {"message": "worker died", "code": 503}}, chat=False).error == "worker died"


CFG = SlowdownConfig(slowdown_ms=100, release_at_batch=8, stall_s=2.0, timeout_s=30.0)


@pytest.mark.parametrize(
    ("batch", "peak", "since_growth", "elapsed", "prefilling", "want"),
    [
        (3, 3, 0.1, 1.0, 5, None),  # still filling
        (8, 8, 0.0, 1.0, 0, "target"),
        (9, 9, 0.0, 1.0, 3, "target"),
        (5, 5, 2.0, 3.0, 0, "stalled"),  # as full as it gets: no growth for stall_s, nothing in prefill
        (5, 5, 9.0, 10.0, 2, None),  # flat, but prompts are still in prefill: they will join
        (0, 0, 5.0, 5.0, 0, None),  # nothing joined yet: not a stall
        (0, 0, 5.0, 30.0, 4, "timeout"),
    ],
)
def test_release_policy(
    batch: int, peak: int, since_growth: float, elapsed: float, prefilling: int, want: str | None
) -> None:
    assert release_reason(batch, peak, since_growth, elapsed, prefilling, CFG) == want


def test_slowdown_config_is_checked() -> None:
    with pytest.raises(ValueError, match="slowdown_ms"):
        SlowdownConfig(slowdown_ms=0, release_at_batch=4)
    with pytest.raises(ValueError, match="release_at_batch"):
        SlowdownConfig(slowdown_ms=10, release_at_batch=0)
