"""vLLM/SGLang request parameters through the real mesh with the official openai client: logit bias,
min_tokens, penalties and structured output change the tiny model's output as they say, on the direct
path (decode worker prefills) and the disaggregated one (the prefill worker samples the first token)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh
from libs.tokenizer import Tokenizer
from tests.e2e.conftest import DIRECT_THRESHOLD

pytestmark = pytest.mark.e2e

PATHS = {"direct": DIRECT_THRESHOLD - 3, "disagg": 40}


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


@pytest.fixture
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="none", max_retries=0, timeout=120)


def prompt_of(n: int) -> list[int]:
    return [(n + 7 * i) % 1000 + 3 for i in range(n)]


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("path", PATHS)
def test_large_logit_bias_forces_a_token(client, tok, path: str) -> None:
    target = tok.encode("hello", add_special_tokens=False)[0]
    r = client.completions.create(
        model=model_of(client), prompt=prompt_of(PATHS[path]), max_tokens=5, temperature=1.0,
        logit_bias={str(target): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == tok.decode([target] * 5)


@pytest.mark.parametrize("path", PATHS)
def test_min_tokens_delays_eos(client, tok, path: str) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    body = {"model": model_of(client), "prompt": prompt_of(PATHS[path]), "max_tokens": 20, "temperature": 0}
    early = client.completions.create(**body, logit_bias={str(eos): 100})
    assert early.usage is not None and early.usage.completion_tokens == 1
    assert early.choices[0].finish_reason == "stop"
    late = client.completions.create(**body, logit_bias={str(eos): 100}, extra_body={"min_tokens": 6})
    assert late.usage is not None and late.usage.completion_tokens == 7
    assert late.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path", PATHS)
def test_penalties_match_the_engine(client, tiny_model: Path, tok, path: str) -> None:
    prompt = prompt_of(PATHS[path])
    kw = {"repetition_penalty": 1.7, "frequency_penalty": 0.8, "presence_penalty": 0.5}
    want = Engine.from_pretrained(tiny_model).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **kw)
    )[0]
    plain = Engine.from_pretrained(tiny_model).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    )[0]
    assert want.token_ids != plain.token_ids  # the penalties matter for this prompt
    r = client.completions.create(
        model=model_of(client), prompt=prompt, max_tokens=16, temperature=0,
        frequency_penalty=kw["frequency_penalty"], presence_penalty=kw["presence_penalty"],
        extra_body={"repetition_penalty": kw["repetition_penalty"], "ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == tok.decode(want.token_ids)


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["town", "city"]},
        "big": {"type": "boolean"},
    },
    "required": ["city", "rank", "kind", "big"],
    "additionalProperties": False,
}


def valid(doc: object) -> bool:
    return (
        isinstance(doc, dict) and set(doc) == set(SCHEMA["properties"])
        and isinstance(doc["city"], str) and re.fullmatch("[a-z]{1,8}", doc["city"]) is not None
        and type(doc["rank"]) is int and 1 <= doc["rank"] <= 99
        and doc["kind"] in ("town", "city") and type(doc["big"]) is bool
    )  # fmt: skip


def test_json_schema_yields_valid_json_100_of_100(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}

    def ask(i: int) -> list[str]:
        content = "Name a place. " * (1 if i % 2 else 6)  # short: direct; long: disaggregated
        r = client.chat.completions.create(
            model=model_of(client), messages=[{"role": "user", "content": content}], n=10,
            max_tokens=60, temperature=1.0, seed=i, response_format=fmt,  # type: ignore[arg-type]
        )  # fmt: skip
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.message.content or "" for c in r.choices]

    with ThreadPoolExecutor(5) as pool:
        texts = [t for ts in pool.map(ask, range(10)) for t in ts]
    assert len(texts) == 100
    bad = [t for t in texts if not valid(json.loads(t))]
    assert not bad, bad[:3]
    assert len(set(texts)) > 10


def test_regex_and_choice_through_the_mesh(client) -> None:
    model = model_of(client)
    for path, n in PATHS.items():
        r = client.completions.create(
            model=model, prompt=prompt_of(n), max_tokens=20, temperature=1.0, n=4,
            extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"},
        )  # fmt: skip
        assert all(re.fullmatch("[a-c]{3}-[0-9]{2}", c.text) for c in r.choices), (path, r.choices)
        r = client.completions.create(
            model=model, prompt=prompt_of(n), max_tokens=20, temperature=1.0, n=4,
            extra_body={"structured_outputs": {"choice": ["left", "right"]}},
        )  # fmt: skip
        assert {c.text for c in r.choices} <= {"left", "right"}, path


@pytest.mark.parametrize("path", PATHS)
def test_a_grammar_the_worker_cannot_compile_is_a_400(client, path: str) -> None:
    with pytest.raises(openai.BadRequestError, match="structured output"):
        client.completions.create(
            model=model_of(client), prompt=prompt_of(PATHS[path]), max_tokens=4,
            extra_body={"guided_regex": "([a-"},
        )  # fmt: skip


def test_unused_openai_fields_are_accepted(client) -> None:
    r = client.chat.completions.create(
        model=model_of(client), messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        store=False, metadata={"team": "a"}, service_tier="auto", reasoning_effort="low",
        parallel_tool_calls=False, user="u-1",
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")


TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {
                "side": {"enum": ["left", "right"]},
                "steps": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["side", "steps"],
            "additionalProperties": False,
        },
    },
}


def test_required_and_named_tool_choice_yield_valid_calls(client) -> None:
    messages = [{"role": "user", "content": "Which way?"}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        r = client.chat.completions.create(
            model=model_of(client), messages=messages, tools=[TOOL], tool_choice=choice,  # type: ignore[arg-type,list-item]
            max_tokens=60, temperature=1.0, n=4, seed=1, parallel_tool_calls=False,
        )  # fmt: skip
        for c in r.choices:
            (call,) = c.message.tool_calls or [None]
            assert call is not None and call.function.name == "pick", (choice, c)  # type: ignore[union-attr]
            args = json.loads(call.function.arguments)  # type: ignore[union-attr]
            assert args["side"] in ("left", "right") and 0 <= args["steps"] <= 9
            assert c.finish_reason == ("tool_calls" if choice == "required" else "stop")


def test_streamed_tool_call_arguments_join_to_the_whole_ones(client) -> None:
    """The same seeded request streamed and not: the call's name comes first, then its arguments in
    fragments whose concatenation is the non-streamed arguments."""
    messages = [{"role": "user", "content": "Which way?"}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        body = dict(
            model=model_of(client), messages=messages, tools=[TOOL], tool_choice=choice,
            max_tokens=60, temperature=1.0, seed=3, parallel_tool_calls=False,
        )  # fmt: skip
        whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
        (call,) = whole.choices[0].message.tool_calls or [None]
        assert call is not None
        first, fragments, finish = None, [], None
        for chunk in client.chat.completions.create(**body, stream=True):  # type: ignore[call-overload]
            for tc in chunk.choices[0].delta.tool_calls or []:
                assert tc.index == 0
                first = first or tc
                fragments.append(tc.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        assert first is not None and first.id and first.type == "function" and first.function.name == "pick"
        assert "".join(fragments) == call.function.arguments and len(fragments) > 3, (choice, fragments)
        assert finish == whole.choices[0].finish_reason
