import json
import shutil
from pathlib import Path

import pytest

from libs.tokenizer import Tokenizer
from libs.tokenizer.chat_template import render_chat

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "<think>plan</think>Hello!"},
    {"role": "user", "content": "Again 🙂"},
]


def test_deepseek_v3_layout(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATION)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.\n\nBe kind."
        "<｜User｜>Hi 你好<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Again 🙂<｜Assistant｜>"
    )
    no_prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<｜Assistant｜>")


@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(tok_dir: Path, tok: Tokenizer, gen: bool) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    for messages in (CONVERSATION, CONVERSATION[2:3], [{"role": "user", "content": "x"}]):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
        want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
        assert tok.encode_chat(messages, add_generation_prompt=gen) == want_ids
    assert tok.encode_chat(CONVERSATION).count(tok.bos_token_id) == 1


TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
TOOL_TURNS = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "x"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get", "arguments": {"city": "y"}}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
]  # fmt: skip


def test_tools_render_in_deepseek_v3_format_as_transformers_does(tok_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    text = tok.apply_chat_template(TOOL_TURNS, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text
    calls = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n{\"city\": \"x\"}\n```"
        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n{\"city\": \"y\"}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    )
    outputs = (
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜Assistant｜>"
    )
    assert text.endswith("<｜User｜>weather?<｜Assistant｜>" + calls + outputs)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    want = hf.apply_chat_template(TOOL_TURNS, tools=TOOLS, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.encode_chat(TOOL_TURNS, tools=TOOLS) == want


def test_bad_messages(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Unsupported message role: developer"):
        tok.apply_chat_template([{"role": "developer", "content": "42"}])
    with pytest.raises(ValueError, match="list of"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="string 'role'"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="JSON-like"):
        tok.apply_chat_template([{"role": "user", "content": object()}])
    with pytest.raises(ValueError, match="chat template failed"):
        tok.apply_chat_template([{"role": "user", "content": ["a", "list"]}])  # str + list in the template


def test_environment_like_transformers() -> None:
    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% set ns.n = ns.n + 1 %}\n"
        "{% endfor %}{{ ns.n }} {{ bos_token }} {{ tools | length }} {{ flag }}"
    )
    messages = [{"role": "user", "content": "<b>&</b> ü"}] * 3
    out = render_chat(template, messages, special_tokens={"bos_token": "<s>"}, tools=[{"a": 1}], flag=True)
    line = json.dumps(messages[0], ensure_ascii=False)  # no HTML escaping, no ASCII escaping
    assert out == f"{line}{line}2 <s> 1 True"  # trim_blocks ate the newline after the tag


def test_template_errors_and_sandbox() -> None:
    with pytest.raises(ValueError, match="custom failure"):
        render_chat("{{ raise_exception('custom failure') }}", [])
    with pytest.raises(ValueError, match="chat template failed"):  # sandbox blocks attribute escapes
        render_chat("{{ ''.__class__.__mro__ }}", [])
    with pytest.raises(ValueError, match="chat template failed"):  # immutable sandbox: no mutation
        render_chat("{% set x = [] %}{{ x.append(1) }}", [])


def test_chat_template_jinja_file(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"
