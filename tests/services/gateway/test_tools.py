"""Tool calling through the official openai client against the gateway and a scripted mesh (DeepSeek-V3's
tool-call format in the model's text), plus the pure parser on split streams: streamed arguments arrive in
fragments whose concatenation is exactly the non-streamed arguments."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from libs.tokenizer import Tokenizer
from proto.messages import Guided
from services.gateway.tool_parser import ToolStream, choice_with_calls, parse_text, stream_step
from services.gateway.tools import tool_plan
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


async def _streamed(client: openai.AsyncOpenAI, **kw: object) -> tuple[str, dict, dict, str | None]:
    """(content, {index: first tool-call delta}, {index: argument fragments}, finish_reason) of a stream."""
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw)  # type: ignore[call-overload]
    content, first, fragments, finish = "", {}, {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in first:
                first[tc.index] = tc
            else:  # later deltas carry only argument text, as OpenAI's
                assert tc.id is None and tc.type is None and tc.function.name is None  # type: ignore[union-attr]
            fragments.setdefault(tc.index, []).append(tc.function.arguments)  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    return content, first, fragments, finish


async def test_auto_streaming(client, fake_mesh: FakeMesh) -> None:
    fake_mesh.text = CALLS
    fake_mesh.per_step = 1  # markers arrive split over many chunks
    content, first, fragments, finish = await _streamed(client, tools=[WEATHER, TIME])
    assert content == "Let me check." and "tool" not in content
    assert {
        i: (tc.id.startswith("chatcmpl-tool-"), tc.type, tc.function.name) for i, tc in first.items()
    } == {
        0: (True, "function", "get_weather"),
        1: (True, "function", "get_time"),
    }
    assert {i: json.loads("".join(f)) for i, f in fragments.items()} == {0: {"city": "Paris"}, 1: {}}
    assert len([f for f in fragments[0] if f]) > 2  # the arguments arrived piece by piece
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    "choice, text",
    [
        ("auto", CALLS),
        ("required", '[ {"name": "get_weather", "parameters": {"city": "Rome, \\"}\\" [x]"} },'
                     ' {"name":"get_time","parameters":{}} ]'),
        ({"type": "function", "function": {"name": "get_weather"}}, ' {"city": "Oslo"}  '),
    ],
    ids=["auto", "required", "named"],
)  # fmt: skip
async def test_streamed_arguments_join_to_the_whole_ones(
    client, fake_mesh: FakeMesh, choice, text: str
) -> None:
    fake_mesh.text, fake_mesh.per_step = text, 1
    whole = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=choice,  # type: ignore[list-item,arg-type]
    )
    calls = whole.choices[0].message.tool_calls or []
    assert calls and all(json.loads(c.function.arguments) is not None for c in calls)  # type: ignore[union-attr]
    content, first, fragments, finish = await _streamed(client, tools=[WEATHER, TIME], tool_choice=choice)
    assert [first[i].function.name for i in sorted(first)] == [c.function.name for c in calls]  # type: ignore[union-attr]
    assert ["".join(fragments[i]) for i in sorted(fragments)] == [c.function.arguments for c in calls]  # type: ignore[union-attr]
    assert len(fragments[0]) > 2  # the first call's arguments arrived piece by piece
    assert (content or None) == whole.choices[0].message.content and finish == whole.choices[0].finish_reason


async def test_sdk_stream_helper_accumulates_the_calls(client, fake_mesh: FakeMesh) -> None:
    """The openai SDK's own accumulator (chat.completions.stream) rebuilds the calls from our deltas."""
    fake_mesh.text, fake_mesh.per_step = CALLS, 1
    async with client.beta.chat.completions.stream(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
    ) as stream:
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


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
    names, args = {}, {}
    for tc in (tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])):
        names.setdefault(tc.index, tc.function.name)  # type: ignore[union-attr]
        args[tc.index] = args.get(tc.index, "") + tc.function.arguments  # type: ignore[union-attr,operator]
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == [
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


REQUIRED = (
    '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "a}\\"b"}}]'
)


@pytest.mark.parametrize(
    "choice, text",
    [("auto", CALLS), ("auto", "plain" + CALLS[len("Let me check."):]), ("required", REQUIRED),
     ({"type": "function", "function": {"name": "get_weather"}}, '\n {"city": "x y"} \n')],
)  # fmt: skip
def test_stream_parser_on_every_split(choice, text: str) -> None:
    plan = tool_plan([WEATHER, TIME], choice)
    assert plan is not None
    want_content, want_calls, want_finish = choice_with_calls(plan, text, "stop")
    assert want_calls
    for cut in range(1, len(text)):
        ts = ToolStream(plan)
        out, names, args = "", {}, {}
        for piece, fin in ((text[:cut], None), (text[cut:], "stop")):
            delta, finish = stream_step(ts, piece, fin)
            out += (delta or {}).get("content", "")
            for d in (delta or {}).get("tool_calls", []):
                names.setdefault(d["index"], d["function"].get("name"))
                args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
        assert (out or None) == want_content and finish == want_finish
        assert [(names[i], args[i]) for i in sorted(names)] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in want_calls
        ]


def test_whole_parse() -> None:
    content, calls = parse_text(CALLS)
    assert content == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    spaced = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜> f \n```json\n \n{"a": 1}\t\n\n```<｜tool▁call▁end｜>'
    assert parse_text(spaced)[1][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}  # stripped
    begun = "text <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
    assert parse_text(begun) == (begun, [])  # no call was named: all of it is content
    cut = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": \n`'
    assert parse_text(cut)[1][0]["function"] == {"name": "f", "arguments": '{"a": \n`'}  # cut short: kept


def test_forced_output_that_is_not_a_call_is_content() -> None:
    plan = tool_plan([WEATHER], "required")
    assert plan is not None
    assert choice_with_calls(plan, "no json here", "length") == ("no json here", [], "length")
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named is not None
    assert choice_with_calls(named, "  ", "length") == ("  ", [], "length")


PIECES = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "\n```json\n", "\n```<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>", "<｜tool", "\n```", "function", "f", " ", "\n", '{"a": 1}', '"', "\\", "{", "}", "[", "]",
    ",", ":", '"name"', '"parameters"', '"get_time"', "x",
]  # fmt: skip
NOISE = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
JSON = st.recursive(
    st.none() | st.integers() | st.text(alphabet='ab "\\{}[]:,\n`', max_size=6),
    lambda inner: st.dictionaries(st.text(alphabet='ab"{}', max_size=3), inner, max_size=3),
    max_leaves=6,
)
SPACE = st.sampled_from(["", " ", "\n", " \t"])
CUT = st.none() | st.integers(min_value=0)


def _cut(text: str, at: int | None) -> str:
    return text if at is None else text[: at % (len(text) + 1)]


@st.composite
def deepseek_output(draw: st.DrawFn) -> str:
    """Noise, then well-formed DeepSeek-V3 calls (any JSON as arguments, whitespace around it, noise between
    calls), the whole perhaps cut short."""
    calls = [
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + draw(st.sampled_from(["get_time", " f "])) + "\n```json\n"
        + draw(SPACE) + json.dumps(draw(JSON)) + draw(SPACE) + "\n```<｜tool▁call▁end｜>" + draw(NOISE)
        for _ in range(draw(st.integers(0, 3)))
    ]  # fmt: skip
    return _cut(draw(NOISE) + "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>", draw(CUT))


@st.composite
def required_output(draw: st.DrawFn) -> str:
    """The JSON array tool_choice required constrains the output to, with free whitespace, perhaps cut short."""
    sep = draw(SPACE)
    items = [
        "{" + sep + '"name":' + sep + json.dumps(draw(st.sampled_from(["get_time", 'a}\\"b']))) + "," + sep
        + '"parameters":' + draw(SPACE) + json.dumps(draw(JSON)) + draw(SPACE) + "}"
        for _ in range(draw(st.integers(0, 3)))
    ]  # fmt: skip
    return _cut("[" + sep + ("," + sep).join(items) + "]", draw(CUT))


NAMED = {"type": "function", "function": {"name": "get_time"}}
OUTPUTS = st.one_of(
    st.tuples(st.just("auto"), deepseek_output() | NOISE),
    st.tuples(st.just("required"), required_output() | NOISE),
    st.tuples(st.just(NAMED), st.builds(lambda a, v, b: a + json.dumps(v) + b, SPACE, JSON, SPACE) | NOISE),
    st.tuples(st.just("none"), deepseek_output()),
)


@settings(max_examples=300, deadline=None)
@given(output=OUTPUTS, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_any_chunking_streams_what_the_whole_parse_gives(output: tuple, cuts: list[int]) -> None:
    choice, text = output
    plan = tool_plan([WEATHER, TIME], choice)
    assert plan is not None
    want_content, want_calls, want_finish = choice_with_calls(plan, text, "stop")
    event(f"{plan.mode}: {min(len(want_calls), 2)} calls")
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    ts, out, names, args = ToolStream(plan), "", {}, {}
    for k, piece in enumerate(pieces):
        delta, finish = stream_step(ts, piece, "stop" if k == len(pieces) - 1 else None)
        out += (delta or {}).get("content", "")
        for d in (delta or {}).get("tool_calls", []):
            names.setdefault(d["index"], d["function"].get("name"))
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert (out or None) == (want_content or None) and finish == want_finish
    assert [(names[i], args[i]) for i in sorted(names)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want_calls
    ]


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_time", 'a}\\"b']), JSON), max_size=3), sep=SPACE)
def test_whole_parse_recovers_what_was_written(calls: list[tuple[str, object]], sep: str) -> None:
    """Against the writer: complete outputs in both formats give back each call's name and arguments."""
    auto = "hi" + "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{sep}{json.dumps(v)}{sep}\n```<｜tool▁call▁end｜>\n"
        for n, v in calls
    ) + "<｜tool▁calls▁end｜>"  # fmt: skip
    items = [{"name": n, "parameters": v} for n, v in calls]
    required = json.dumps(items, separators=("," + sep, ":" + sep))
    for choice, text in (("auto", auto), ("required", required)):
        plan = tool_plan([WEATHER, TIME], choice)
        assert plan is not None
        content, got, _ = choice_with_calls(plan, text, "stop")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
        if choice == "auto":
            assert content == ("hi" if calls else auto)
