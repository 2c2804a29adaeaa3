"""Tool calling through the official openai client against the gateway and a scripted mesh (DeepSeek-V3's
tool-call format in the model's text), plus the pure parser on split streams."""

from __future__ import annotations

import json

import openai
import pytest

from libs.tokenizer import Tokenizer
from proto.messages import Guided
from services.gateway.tools import ToolStream, parse_text, stream_step, tool_plan
from tests.services.gateway.conftest import MODEL
from tests.services.gateway.fake_mesh import FakeMesh

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time?"}]


def call_text(name: str, args: dict) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```<｜tool▁call▁end｜>"


CALLS = (
    "Let me check."
    + "<｜tool▁calls▁begin｜>"
    + call_text("get_weather", {"city": "Paris"})
    + "\n"
    + call_text("get_time", {})
    + "<｜tool▁calls▁end｜>"
)


@pytest.fixture
def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_auto_parses_calls_and_renders_tools(client, fake_mesh: FakeMesh, tokenizer: Tokenizer) -> None:
    fake_mesh.text = CALLS
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])  # type: ignore[list-item]
    (sub,) = fake_mesh.submits
    assert "get_weather" in tokenizer.decode(sub.prompt_ids) and sub.sampling.guided is None
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2


async def test_auto_streaming(client, fake_mesh: FakeMesh) -> None:
    fake_mesh.text = CALLS
    fake_mesh.per_step = 1  # markers arrive split over many chunks
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        stream=True,  # type: ignore[list-item]
    )
    content, calls, finish = "", {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))  # type: ignore[union-attr,arg-type]
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and "tool" not in content
    assert calls == {0: ("get_weather", {"city": "Paris"}), 1: ("get_time", {})}
    assert finish == "tool_calls"


async def test_plain_text_with_tools_stays_content(client, fake_mesh: FakeMesh) -> None:
    fake_mesh.text = "No tools needed <｜tool"  # a prefix of the marker that never completes
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])  # type: ignore[list-item]
    assert r.choices[0].message.content == "No tools needed <｜tool" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


async def test_none_neither_renders_nor_parses(client, fake_mesh: FakeMesh, tokenizer: Tokenizer) -> None:
    fake_mesh.text = CALLS
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none"
    )  # type: ignore[list-item]
    assert "get_weather" not in tokenizer.decode(fake_mesh.submits[0].prompt_ids)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


async def test_named_and_required_are_constrained_and_parsed(client, fake_mesh: FakeMesh) -> None:
    fake_mesh.text = '{"city": "Oslo"}'
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert fake_mesh.submits[0].sampling.guided == Guided(
        "json", json.dumps(WEATHER["function"]["parameters"])
    )
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    assert r.choices[0].message.content is None

    fake_mesh.text = (
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        stream=True,  # type: ignore[list-item]
    )
    chunks = [c async for c in stream]
    schema = json.loads(fake_mesh.submits[1].sampling.guided.value)  # type: ignore[union-attr]
    assert schema["type"] == "array" and schema["minItems"] == 1
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [  # type: ignore[union-attr,arg-type]
        ("get_time", {}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "tools, choice, match",
    [
        ([{"type": "function"}], None, "tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
        (None, "required", "needs `tools`"),
        ([WEATHER], "sometimes", "tool_choice"),
    ],
)
async def test_bad_tools_are_400(client, fake_mesh: FakeMesh, tools, choice, match: str) -> None:
    body = {"tools": tools, "tool_choice": choice}
    with pytest.raises(openai.BadRequestError, match=match):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)
    assert not fake_mesh.submits


def test_stream_parser_on_every_split() -> None:
    plan = tool_plan([WEATHER, TIME], "auto")
    assert plan is not None
    want_content, want_calls = parse_text(CALLS)
    for cut in range(1, len(CALLS)):
        ts = ToolStream(plan)
        out, calls = "", []
        for piece, fin in ((CALLS[:cut], None), (CALLS[cut:], "stop")):
            delta, finish = stream_step(ts, piece, fin)
            out += (delta or {}).get("content", "")
            calls += (delta or {}).get("tool_calls", [])
        assert out == want_content and finish == "tool_calls"
        assert [c["function"] for c in calls] == [c["function"] for c in want_calls]
        assert [c["index"] for c in calls] == [0, 1]
