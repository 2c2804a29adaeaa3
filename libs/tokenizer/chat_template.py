"""Render Hugging Face chat templates (jinja2) the way transformers does, without transformers."""

# Templates are untrusted code from checkpoint folders, so they run in jinja's immutable sandbox with
# the same environment transformers builds (trim_blocks, lstrip_blocks, loopcontrols, a no-op
# `{% generation %}` tag, `raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`), and
# everything the template sees is rebuilt from plain JSON types first. A template error (including
# `raise_exception`) surfaces as ValueError, which the gateway reports as a 400.

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text; a syntax error becomes ValueError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e


def plain_data(value: Any) -> Any:
    """Rebuild a value from JSON types, so the sandboxed template never sees rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    raise ValueError(f"chat messages may hold only JSON-like values, got {type(value).__name__}")


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    plain = plain_data(list(messages))
    for i, message in enumerate(plain):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role'")
        # OpenAI clients send content=None with tool calls; transformers drops None values the same way.
        for key in [k for k, v in message.items() if v is None]:
            del message[key]
    return plain


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render messages; special_tokens (bos_token, eos_token, ...) become template variables, as in transformers."""
    compiled = compile_template(template)
    context: dict[str, Any] = {k: plain_data(v) for k, v in kwargs.items()}
    context.update({k: v for k, v in (special_tokens or {}).items()})
    context.update(
        messages=_check_messages(messages),
        tools=plain_data(tools) if tools is not None else None,
        documents=plain_data(documents) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
    )
    try:
        return compiled.render(**context)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e
