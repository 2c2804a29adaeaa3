"""Reasoning output (`reasoning_content`) through the official openai client against the gateway and a scripted
mesh whose text holds DeepSeek's `</think>`, on a checkpoint whose chat template is DeepSeek-V3.1's thinking
switch; plus the pure parser on every split of its text (markers cut across chunks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from libs.tokenizer import Tokenizer
from libs.tokenizer.build import CHAT_TEMPLATE
from services.gateway.choice_parser import ChoiceParser, whole_message
from services.gateway.reasoning import ReasoningStream, resolve_parser, split_reasoning, starts_in_reasoning
from services.gateway.tools import ToolPlan
from tests.services.gateway.conftest import MODEL, StartGateway, base_url
from tests.services.gateway.fake_mesh import FakeMesh
from tests.services.gateway.test_tools import CALLS, MESSAGES, TIME, WEATHER

# DeepSeek-V3.1's generation prompt: `<think>` opens the reasoning when thinking is asked, `</think>` skips it
GENERATION = "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
V31_TEMPLATE = CHAT_TEMPLATE.replace(
    GENERATION,
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}",
)
THOUGHT = "The user asks 2+2. <think> is just text here; a <｜tool▁calls▁begin｜> in thought stays thought."
ANSWER = "\n\nIt is 4."
THINKING = {"chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def v31_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("v31-model")
    for f in model_dir.iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert GENERATION in cfg["chat_template"]
    cfg["chat_template"] = V31_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
async def client(start_gateway: StartGateway, fake_mesh: FakeMesh, v31_dir: Path) -> openai.AsyncOpenAI:
    gw = await start_gateway(model_dir=str(v31_dir))  # reasoning_parser auto: the template writes <think>
    assert gw.info.reasoning_parser == "deepseek_r1"
    return openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="unused", max_retries=0)


async def _stream(client: openai.AsyncOpenAI, **kw: object) -> tuple[list[str], list[str], list, str | None]:
    """(reasoning pieces, content pieces, tool-call deltas, finish_reason) of a streamed chat."""
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw)  # type: ignore[call-overload]
    thought: list[str] = []
    content: list[str] = []
    calls: list = []
    finish = None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            assert not content, "reasoning after the answer began"
            thought.append(delta.reasoning_content)  # type: ignore[attr-defined]
        content += [delta.content] if delta.content else []
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return thought, content, calls, finish


async def test_thinking_splits_whole_and_streamed(client, fake_mesh: FakeMesh, tokenizer: Tokenizer) -> None:
    fake_mesh.text, fake_mesh.per_step = THOUGHT + "</think>" + ANSWER, 1  # markers cut over many chunks
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=THINKING)  # type: ignore[arg-type]
    assert tokenizer.decode(fake_mesh.submits[0].prompt_ids).endswith("<｜Assistant｜><think>")
    msg = r.choices[0].message
    assert msg.reasoning_content == THOUGHT and msg.content == ANSWER  # type: ignore[attr-defined]
    assert r.choices[0].finish_reason == "stop"
    thought, content, _, finish = await _stream(client, extra_body=THINKING)
    assert "".join(thought) == THOUGHT and "".join(content) == ANSWER and finish == "stop"
    assert len(thought) > 5  # streamed piece by piece, not held to the end


async def test_non_thinking_turn_is_all_answer(client, fake_mesh: FakeMesh, tokenizer: Tokenizer) -> None:
    fake_mesh.text = "Plain answer </think> with the marker as text."
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert tokenizer.decode(fake_mesh.submits[0].prompt_ids).endswith("<｜Assistant｜></think>")
    msg = r.choices[0].message
    assert msg.content == fake_mesh.text and getattr(msg, "reasoning_content", None) is None


async def test_reasoning_cut_short_has_no_content(client, fake_mesh: FakeMesh) -> None:
    fake_mesh.text = THOUGHT
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=THINKING)  # type: ignore[arg-type]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None
    assert msg.reasoning_content and THOUGHT.startswith(msg.reasoning_content)  # type: ignore[attr-defined]


async def test_tool_calls_are_read_from_the_answer(client, fake_mesh: FakeMesh) -> None:
    fake_mesh.text, fake_mesh.per_step = THOUGHT + "</think>" + CALLS, 1
    kw = {"tools": [WEATHER, TIME], "extra_body": THINKING}
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)  # type: ignore[arg-type]
    msg = r.choices[0].message
    assert msg.reasoning_content == THOUGHT and msg.content == "Let me check."  # type: ignore[attr-defined]
    assert [c.function.name for c in msg.tool_calls or []] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert r.choices[0].finish_reason == "tool_calls"
    thought, content, calls, finish = await _stream(client, **kw)
    assert "".join(thought) == THOUGHT and "".join(content) == "Let me check." and finish == "tool_calls"
    assert [c.function.name for c in calls if c.function.name] == ["get_weather", "get_time"]


async def test_constraints_start_after_the_reasoning(client, fake_mesh: FakeMesh, tokenizer: Tokenizer) -> None:
    fake_mesh.text = THOUGHT + '</think>{"a": 1}'
    fmt = {"type": "json_object"}
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, extra_body=THINKING)  # type: ignore[arg-type]
    assert json.loads(r.choices[0].message.content or "") == {"a": 1}
    guided = fake_mesh.submits[0].sampling.guided
    assert guided is not None and guided.kind == "json_object"
    assert guided.start_after == tokenizer.encode("</think>", add_special_tokens=False)
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                         extra_body=THINKING)  # type: ignore[arg-type]  # fmt: skip
    assert fake_mesh.submits[1].sampling.guided.start_after == guided.start_after  # type: ignore[union-attr]
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt)  # type: ignore[arg-type]
    assert fake_mesh.submits[2].sampling.guided.start_after == []  # type: ignore[union-attr]  # no reasoning: at once


async def test_template_kwargs_may_not_replace_the_requests_fields(client, fake_mesh: FakeMesh) -> None:
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"chat_template_kwargs": {"messages": []}}
        )
    assert not fake_mesh.submits


async def test_parser_named_on_a_plain_template(start_gateway: StartGateway, fake_mesh: FakeMesh) -> None:
    """deepseek_r1 forced on a template without <think> (auto would pick none): R1's rule, all before
    </think> is reasoning."""
    gw = await start_gateway(reasoning_parser="deepseek_r1")
    client = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="unused", max_retries=0)
    fake_mesh.text = "<think>" + THOUGHT + "</think>" + ANSWER
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert r.choices[0].message.reasoning_content == THOUGHT and r.choices[0].message.content == ANSWER  # type: ignore[attr-defined]


# --- the pure parser -------------------------------------------------------------------------------

CASES = [  # (text, starts in reasoning, reasoning, answer)
    (THOUGHT + "</think>" + ANSWER, True, THOUGHT, ANSWER),  # R1: the prompt opened <think>
    ("\n<think>\n" + THOUGHT + "</think>" + ANSWER, True, "\n" + THOUGHT, ANSWER),  # the model opens it
    ("</think>" + ANSWER, True, "", ANSWER),
    (THOUGHT + "</thin", True, THOUGHT + "</thin", ""),  # cut short inside a marker
    ("<thi", True, "<thi", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    (THOUGHT + "</think>" + ANSWER, False, None, THOUGHT + "</think>" + ANSWER),  # V3.1 non-thinking
]


@pytest.mark.parametrize("text, in_reasoning, thought, answer", CASES)
def test_every_split_streams_what_the_whole_split_gives(text, in_reasoning, thought, answer) -> None:
    assert split_reasoning(text, in_reasoning) == (thought, answer)
    cuts = [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]  # one cut anywhere; every char
    for cut in cuts:
        pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)], strict=True)]
        rs = ReasoningStream.for_prompt(in_reasoning)
        got = [rs.feed(p) for p in pieces]
        streamed = "".join(r for r, _ in got) + rs.finish()
        assert (streamed if in_reasoning else None, "".join(a for _, a in got)) == (thought, answer), cut


def test_choice_parser_streams_reasoning_then_calls() -> None:
    text = THOUGHT + "</think>" + CALLS
    whole = whole_message(True, ToolPlan("auto", [WEATHER, TIME]), text, "stop")
    assert (whole.reasoning_content, whole.content, whole.finish_reason) == (THOUGHT, "Let me check.", "tool_calls")
    parser = ChoiceParser.create(True, ToolPlan("auto", [WEATHER, TIME]))
    deltas = [parser.step(c, None)[0] for c in text] + [parser.step("", "stop")[0]]
    got = [d for d in deltas if d]
    assert "".join(d.get("reasoning_content", "") for d in got) == THOUGHT
    assert "".join(d.get("content", "") for d in got) == "Let me check."
    names = [c["function"]["name"] for d in got for c in d.get("tool_calls", []) if "id" in c]
    assert names == ["get_weather", "get_time"]


def test_parser_choice() -> None:
    assert resolve_parser("auto", V31_TEMPLATE) == "deepseek_r1" and resolve_parser("auto", CHAT_TEMPLATE) is None
    assert resolve_parser("auto", None) is None and resolve_parser("none", V31_TEMPLATE) is None
    assert resolve_parser("deepseek_r1", CHAT_TEMPLATE) == "deepseek_r1"
    with pytest.raises(ValueError, match="reasoning_parser"):
        resolve_parser("qwen3", None)
    assert starts_in_reasoning("<｜Assistant｜><think>\n") and not starts_in_reasoning("<｜Assistant｜></think>")
