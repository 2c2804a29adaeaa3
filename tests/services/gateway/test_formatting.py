"""Response shapes: SSE framing, chunks, usage, both logprobs formats, error bodies."""

from __future__ import annotations

import json

from services.gateway import formatting as fmt
from services.gateway.errors import ApiError, bad_param, error_body, mesh_error, unsupported

ENTRIES = [
    fmt.LogprobEntry("Hel", [72, 101, 108], -0.5, [fmt.TopEntry("Hel", [72, 101, 108], -0.5), fmt.TopEntry("He", [72, 101], -1.5)], 0),
    fmt.LogprobEntry("lo", [108, 111], float("-inf"), [fmt.TopEntry("lo", [108, 111], float("-inf"))], 3),
]  # fmt: skip


def _parse_sse(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    assert b"\n" not in data[:-2], "one event is one line"
    return json.loads(data[len(b"data: ") : -2])


def test_sse_framing_and_done() -> None:
    obj = {"a": "line\nbreak", "b": "日本"}
    assert _parse_sse(fmt.sse(obj)) == obj
    assert fmt.SSE_DONE == b"data: [DONE]\n\n"


def test_usage_totals_and_cached_details() -> None:
    assert fmt.Usage(7, 5, 3).as_dict() == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_chat_chunk_shape_with_and_without_usage_field() -> None:
    c = fmt.chat_chunk("id1", 5, "m", 2, {"content": "x"}, finish_reason="stop")
    assert c == {
        "id": "id1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [{"index": 2, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}],
    }
    assert fmt.chat_chunk("id1", 5, "m", 0, {}, with_usage_field=True)["usage"] is None
    u = fmt.usage_chunk("id1", "chat.completion.chunk", 5, "m", fmt.Usage(1, 2))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 3


def test_chat_logprobs_format_clamps_minus_infinity() -> None:
    lp = fmt.chat_logprobs(ENTRIES)
    first, second = lp["content"]
    assert first == {
        "token": "Hel",
        "logprob": -0.5,
        "bytes": [72, 101, 108],
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
            {"token": "He", "logprob": -1.5, "bytes": [72, 101]},
        ],
    }
    assert second["logprob"] == fmt.MIN_LOGPROB and second["top_logprobs"][0]["logprob"] == fmt.MIN_LOGPROB
    json.dumps(lp, allow_nan=False)  # valid JSON: no -Infinity


def test_completion_logprobs_format() -> None:
    lp = fmt.completion_logprobs(ENTRIES)
    assert lp == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, fmt.MIN_LOGPROB],
        "top_logprobs": [{"Hel": -0.5, "He": -1.5}, {"lo": fmt.MIN_LOGPROB}],
        "text_offset": [0, 3],
    }


def test_full_responses() -> None:
    choices = [fmt.Choice(0, "Hello", "length", ENTRIES), fmt.Choice(1, "Hi", "stop")]
    chat = fmt.chat_response("c", 1, "m", choices, fmt.Usage(4, 3, 1))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"] == "Hello"
    assert chat["choices"][0]["logprobs"]["content"][1]["token"] == "lo"
    assert chat["choices"][1]["logprobs"] is None and chat["choices"][1]["finish_reason"] == "stop"
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    comp = fmt.completion_response("c", 1, "m", choices, fmt.Usage(4, 3))
    assert comp["object"] == "text_completion"
    assert [c["text"] for c in comp["choices"]] == ["Hello", "Hi"]
    assert comp["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    chunk = fmt.completion_chunk("c", 1, "m", 3, "x", logprobs=ENTRIES[:1])
    assert chunk["choices"][0]["index"] == 3 and chunk["choices"][0]["logprobs"]["tokens"] == ["Hel"]


def test_error_bodies() -> None:
    assert error_body(404, "nope", param="model", code="model_not_found") == {
        "error": {"message": "nope", "type": "not_found_error", "param": "model", "code": "model_not_found"}
    }
    e = bad_param("temperature", "must be <= 2")
    assert (e.status, e.param) == (400, "temperature") and "temperature" in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"
    u = unsupported("tools", "tool calling")
    assert u.status == 400 and "not supported" in u.message and u.param == "tools"
    assert mesh_error(429, "queue full").status == 429
    assert mesh_error(503, "no decode worker").body()["error"]["message"] == "no decode worker"
    assert mesh_error(999, "odd").status == 500
    assert isinstance(mesh_error(504, "late"), ApiError)


def test_models_list() -> None:
    body = fmt.models_list(["tiny"], 10, 128)
    assert body["object"] == "list"
    assert body["data"] == [
        {"id": "tiny", "object": "model", "created": 10, "owned_by": "moemesh", "max_model_len": 128}
    ]
