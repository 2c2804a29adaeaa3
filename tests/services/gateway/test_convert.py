"""Request validation and conversion to proto (pure: schemas.py + convert.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from libs.tokenizer import Tokenizer
from proto.messages import Guided, Sampling
from services.gateway.app import validation_error
from services.gateway.convert import ModelInfo, plan_chat, plan_completion
from services.gateway.errors import ApiError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, PromptUnion, split_unknown
from tests.services.gateway.conftest import MAX_CONTEXT

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def info(tokenizer: Tokenizer) -> ModelInfo:
    return ModelInfo("m", MAX_CONTEXT, tokenizer.vocab_size)


def chat(tokenizer: Tokenizer, info: ModelInfo, **kw: Any):
    return plan_chat(ChatCompletionRequest.model_validate({**CHAT, **kw}), tokenizer, info)


def completion(tokenizer: Tokenizer, info: ModelInfo, **kw: Any):
    return plan_completion(CompletionRequest.model_validate({"model": "m", **kw}), tokenizer, info)


def invalid(model: type[pydantic.BaseModel], body: dict) -> ApiError:
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value)


def test_chat_uses_the_checkpoint_template(tokenizer: Tokenizer, info: ModelInfo) -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    plan = chat(tokenizer, info, messages=msgs)
    expected = tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert plan.prompts == [expected]
    assert expected[0] == tokenizer.bos_token_id  # the template writes BOS once
    assert expected.count(tokenizer.bos_token_id) == 1


def test_sampling_conversion(tokenizer: Tokenizer, info: ModelInfo) -> None:
    plan = chat(
        tokenizer, info, max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1,
        seed=11, stop="\n", stop_token_ids=[5], ignore_eos=True, logprobs=True, top_logprobs=3, user="u",
        presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"}, tool_choice="none",
    )  # fmt: skip
    (c,) = plan.choices
    assert c.sampling == Sampling(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=11, stop_token_ids=[5],
        stop=["\n"], ignore_eos=True, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert plan.stop == ["\n"] and plan.logprobs and plan.top_logprobs == 3


def test_chat_default_max_tokens_is_the_rest_of_the_context(tokenizer: Tokenizer, info: ModelInfo) -> None:
    plan = chat(tokenizer, info)
    assert plan.choices[0].sampling.max_tokens == MAX_CONTEXT - len(plan.prompts[0])
    plan = completion(tokenizer, info, prompt="hello")
    assert plan.choices[0].sampling.max_tokens == 16  # OpenAI's completions default


def test_n_choices_get_indices_and_consecutive_seeds(tokenizer: Tokenizer, info: ModelInfo) -> None:
    plan = completion(tokenizer, info, prompt=["one", "two two"], n=3, seed=40)
    assert [c.index for c in plan.choices] == list(range(6))
    assert [c.prompt_index for c in plan.choices] == [0, 0, 0, 1, 1, 1]
    assert [c.sampling.seed for c in plan.choices] == [40, 41, 42, 40, 41, 42]
    assert plan.prompts == [tokenizer.encode("one"), tokenizer.encode("two two")]
    unseeded = completion(tokenizer, info, prompt="x", n=2)
    assert [c.sampling.seed for c in unseeded.choices] == [None, None]


@pytest.mark.parametrize(
    "prompt, expected",
    [([5, 6, 7], [[5, 6, 7]]), ([[5, 6], [7]], [[5, 6], [7]]), (["a b"], None)],
)
def test_completion_prompt_forms(tokenizer: Tokenizer, info: ModelInfo, prompt: Any, expected: Any) -> None:
    plan = completion(tokenizer, info, prompt=prompt, logprobs=0)
    assert plan.prompts == (expected if expected is not None else [tokenizer.encode("a b")])
    assert plan.logprobs and plan.top_logprobs == 0


@pytest.mark.parametrize("prompt", ["", [], [[]], [[1], []]])
def test_empty_prompt_is_refused(tokenizer: Tokenizer, info: ModelInfo, prompt: Any) -> None:
    with pytest.raises(ApiError, match="empty") as e:
        completion(tokenizer, info, prompt=prompt)
    assert e.value.status == 400 and e.value.param == "prompt"


def test_token_ids_out_of_vocab_are_refused(tokenizer: Tokenizer, info: ModelInfo) -> None:
    with pytest.raises(ApiError, match=f"token id {info.vocab_size} is out of range"):
        completion(tokenizer, info, prompt=[1, info.vocab_size])


_int = st.integers(-3, 3) | st.integers(0, 99) | st.integers(2**62, 2**64)
_ids = _int | st.booleans() | st.floats(-1, 5) | st.sampled_from(["7", "x", ""]) | st.none()


@given(
    st.lists(st.integers(0, 2**31), max_size=40)
    | st.lists(_int, max_size=6)
    | st.lists(_ids, max_size=6)
    | st.lists(st.lists(_int, max_size=5) | st.lists(_ids, max_size=3) | _ids, max_size=4)
    | st.text(max_size=5)
    | st.lists(st.text(max_size=3), max_size=3)
)
@example([-1])
@example([3, -2])
@example([True, 2])
@example([1.0, 2])
@example(["7", 1])
@example([2**64])
@example([[1], [-2]])
@example([[True]])
@example([[], [1]])
@example([])
def test_the_token_id_fast_path_validates_as_the_union_does(prompt: Any) -> None:
    """A prompt of plain non-negative ints skips pydantic's per-id union validation: the value, and every
    refusal, must be what the union alone gives."""
    union = pydantic.TypeAdapter(PromptUnion)
    try:
        expected: Any = union.validate_python(prompt)
    except pydantic.ValidationError as e:
        expected = [(err["type"], err["loc"]) for err in e.errors()]
    try:
        got: Any = CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt
    except pydantic.ValidationError as e:
        got = [(err["type"], err["loc"][1:]) for err in e.errors()]  # less the leading "prompt"
    assert repr(got) == repr(expected)  # the same values of the same types (True is not 1)


def test_the_prompt_schema_is_the_unions() -> None:
    schema = CompletionRequest.model_json_schema()
    assert schema["properties"]["prompt"]["anyOf"] == pydantic.TypeAdapter(PromptUnion).json_schema()["anyOf"]


@pytest.mark.parametrize("prompt", [[5, -1], [[1], [2, -3]]])
def test_a_negative_token_id_is_a_validation_error_naming_the_prompt(prompt: list) -> None:
    e = invalid(CompletionRequest, {"model": "m", "prompt": prompt})
    assert e.status == 400 and e.param == "prompt"


def test_context_limit(tokenizer: Tokenizer, info: ModelInfo) -> None:
    ids = list(range(2, 102))  # 100 tokens
    assert (
        completion(tokenizer, info, prompt=ids, max_tokens=MAX_CONTEXT - 100).choices[0].sampling.max_tokens
        == MAX_CONTEXT - 100
    )
    with pytest.raises(ApiError) as e:
        completion(tokenizer, info, prompt=ids, max_tokens=MAX_CONTEXT - 99)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    assert f"maximum context length is {MAX_CONTEXT}" in e.value.message
    with pytest.raises(ApiError, match="context length"):  # a prompt that fills the context alone
        completion(tokenizer, info, prompt=[(i % 1000) + 2 for i in range(MAX_CONTEXT)])
    with pytest.raises(ApiError) as e:
        chat(tokenizer, info, messages=[{"role": "user", "content": "word " * (2 * MAX_CONTEXT)}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
        ("n", 0), ("n", 17), ("top_logprobs", 21), ("min_p", 2), ("top_k", -2), ("seed", -1),
        ("stop", [""]), ("stop", ["s"] * 17), ("messages", []),
    ],
)  # fmt: skip
def test_bad_values_name_the_param(field: str, value: Any) -> None:
    err = invalid(ChatCompletionRequest, {**CHAT, field: value})
    assert err.status == 400 and err.param == field and err.message.startswith(field)


def test_unknown_fields_are_dropped_unless_they_change_the_output() -> None:
    body = {**CHAT, "store": True, "metadata": {"a": "b"}, "service_tier": "auto", "reasoning_effort": "low"}
    data, ignored = split_unknown(ChatCompletionRequest, body)
    assert ignored == ["metadata", "reasoning_effort", "service_tier", "store"] and data == CHAT
    assert split_unknown(ChatCompletionRequest, {**CHAT, "user": "u"})[1] == []  # known, unused
    with pytest.raises(ApiError, match="not supported") as e:
        split_unknown(ChatCompletionRequest, {**CHAT, "functions": []})
    assert e.value.param == "functions"


def test_constraints_reach_the_wire(tokenizer: Tokenizer, info: ModelInfo) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plan = chat(
        tokenizer, info, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_tokens=3,
        logit_bias={"5": 1, "6": -300}, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    (c,) = plan.choices
    s = c.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (0.5, -1, 1.2, 3)
    assert s.logit_bias == {5: 1.0, 6: -100.0} and s.guided == Guided("json", json.dumps(schema))
    cases = {
        "guided_regex": ("a+", Guided("regex", "a+")),
        "guided_choice": (["x", "y"], Guided("choice", '["x", "y"]')),
        "guided_grammar": ("root ::= \"a\"", Guided("grammar", 'root ::= "a"')),
        "structured_outputs": ({"json_object": True}, Guided("json_object")),
    }
    for field, (value, want) in cases.items():
        assert completion(tokenizer, info, prompt="x", **{field: value}).choices[0].sampling.guided == want
    assert chat(tokenizer, info, response_format={"type": "json_object"}).choices[0].sampling.guided == Guided(
        "json_object"
    )


def test_unknown_and_missing_fields() -> None:
    err = invalid(ChatCompletionRequest, {**CHAT, "best_guess": 1})
    assert err.param == "best_guess" and "unrecognized request argument" in err.message
    assert invalid(CompletionRequest, {"model": "m"}).param == "prompt"
    assert invalid(CompletionRequest, {"prompt": "x"}).param == "model"
    assert invalid(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 21}).param == "logprobs"
    assert invalid(CompletionRequest, {"model": "m", "prompt": [1, "a"]}).param == "prompt"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"), ({"guided_choice": []}, "guided_choice"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)  # fmt: skip
def test_unsupported_chat_params_are_refused(
    tokenizer: Tokenizer, info: ModelInfo, extra: dict, param: str
) -> None:
    with pytest.raises(ApiError) as e:
        chat(tokenizer, info, **extra)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(
    "extra, param", [({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix")]
)
def test_unsupported_completion_params_are_refused(
    tokenizer: Tokenizer, info: ModelInfo, extra: dict, param: str
) -> None:
    with pytest.raises(ApiError, match="not supported") as e:
        completion(tokenizer, info, prompt="x", **extra)
    assert e.value.param == param


def test_template_error_is_a_400(tokenizer: Tokenizer, info: ModelInfo) -> None:
    with pytest.raises(ApiError, match="chat template") as e:
        chat(tokenizer, info, messages=[{"role": "developer", "content": "x"}])  # the tiny template refuses it
    assert e.value.status == 400 and e.value.param == "messages"


def test_model_info_from_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "vocab_size": 10}))
    assert ModelInfo.from_dir(tmp_path, "x") == ModelInfo("x", 64, 10)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelInfo.from_dir(tmp_path, "x")
    with pytest.raises(ValueError, match="cannot read"):
        ModelInfo.from_dir(tmp_path / "missing", "x")


@pytest.mark.parametrize(
    ("counting", "fast"), [("chunk_usage", True), ("chunk_logprobs", True), ("top_logprobs", False)]
)
def test_what_the_slowdown_bench_sends_takes_the_engines_fast_decode_path(
    tokenizer: Tokenizer, info: ModelInfo, counting: str, fast: bool
) -> None:
    """`moemesh bench --slowdown-ms` measures the decode path the Engine-alone comparison runs: its requests
    (continuous usage) reach the engine as one-pass sampling with no logits processing (overlapped decode's
    condition); the chosen token's logprob comes from the same pass, top alternatives from the exact sampler."""
    from libs.engine.sampling import one_pass_ok
    from libs.loadgen.client import Endpoint, request_body
    from libs.loadgen.datasets import BenchRequest
    from libs.loadgen.slowdown import slowdown_endpoint
    from libs.worker.wire import to_params

    ep = slowdown_endpoint(Endpoint("http://h", model="m"))
    if counting != "chunk_usage":
        extra = {"logprobs": 2} if counting == "top_logprobs" else {}
        ep = Endpoint("http://h", model="m", chunk_logprobs=True, extra_body=extra)
    body = request_body(ep, BenchRequest([5, 6, 7], 3, 100))
    plan = plan_completion(CompletionRequest.model_validate(body), tokenizer, info)
    params = to_params(plan.choices[0].sampling)
    assert (one_pass_ok(params) and not params.needs_processing) == fast
    assert params.wants_logprobs == (counting != "chunk_usage")
    assert plan.continuous_usage == (counting == "chunk_usage")
