"""Tool calling for DeepSeek-V3's chat format: what the request asks (`ToolPlan`) and tool calls parsed
out of the output, whole or streamed.

tool_choice, as vLLM implements it:
- "auto" (the default with tools): the template renders the tools; the output is scanned for DeepSeek-V3
  tool calls (`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`); text before them is the message content.
- "none": no tools rendered, nothing parsed.
- "required" / a named function: the output is constrained by a JSON schema (structured output) — a
  non-empty array of {"name", "parameters"} for required, the function's parameters for a named one —
  and becomes the tool calls.
Pure code: no I/O, no tokenizer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from proto.messages import Guided
from services.gateway.errors import bad_param

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # auto | none | required | named
    tools: list[dict[str, Any]]
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: False allows one call at most

    @property
    def render(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model."""
        return None if self.mode == "none" else self.tools

    def guided(self) -> Guided | None:
        """The structured output that forces the call(s), for required / named."""
        params = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools
        }
        if self.mode == "named":
            assert self.name is not None
            return Guided("json", json.dumps(params[self.name]))
        if self.mode == "required":
            item = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": n}, "parameters": p},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for n, p in params.items()
                ]
            }
            bounds = {"minItems": 1} if self.parallel else {"minItems": 1, "maxItems": 1}
            return Guided("json", json.dumps({"type": "array", "items": item, **bounds}))
        return None


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None = None) -> ToolPlan | None:
    """The request's tools and tool_choice checked (400 naming the parameter); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_param("tool_choice", "needs `tools`")
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_param("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_param("tools", f"tools[{i}].function.name must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_param("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if tool_choice in (None, "auto", "none", "required"):
        return ToolPlan(tool_choice or "auto", list(tools), parallel=parallel is not False)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise bad_param(
            "tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name': ...}}"
        )
    if name not in names:
        raise bad_param("tool_choice", f"function {name!r} is not among the tools")
    return ToolPlan("named", list(tools), name)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _calls_in(section: str) -> list[dict[str, Any]]:
    return [_call(m["name"].strip(), m["args"].strip()) for m in _CALL.finditer(section)]


def parse_text(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole DeepSeek-V3 output; content None when only calls were made."""
    head, sep, rest = text.partition(CALLS_BEGIN)
    if not sep:
        return text, []
    calls = _calls_in(rest)
    if not calls:
        return text, []
    return head or None, calls


def parse_forced(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """Tool calls from the JSON a required / named choice was constrained to (none if it is cut short)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    if plan.mode == "named":
        assert plan.name is not None
        return [_call(plan.name, json.dumps(doc, ensure_ascii=False))]
    return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in doc]


@dataclass
class ToolStream:
    """One streamed choice: content flows until the tool-call section begins (text that could begin it is
    held back); each call is emitted whole once its end marker arrives. For required / named, the JSON is
    held to the end and emitted as the calls."""

    plan: ToolPlan
    buf: str = ""
    in_calls: bool = False
    emitted: int = 0  # calls sent so far
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, new complete tool calls) after `text`."""
        self.buf += text
        if self.plan.mode != "auto":
            return "", []
        if not self.in_calls:
            head, sep, rest = self.buf.partition(CALLS_BEGIN)
            if not sep:
                keep = _partial_suffix(self.buf, CALLS_BEGIN)
                out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return out, []
            self.in_calls, self.buf = True, rest
            return head, self._new_calls()
        return "", self._new_calls()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content left, calls left) at the end of the choice."""
        if self.plan.mode != "auto":
            self.calls = parse_forced(self.plan, self.buf)
            return ("" if self.calls else self.buf), self.calls
        if self.in_calls:
            return "", self._new_calls()
        out, self.buf = self.buf, ""
        return out, []

    def _new_calls(self) -> list[dict[str, Any]]:
        found = _calls_in(self.buf)
        new = found[self.emitted :]
        self.emitted = len(found)
        self.calls += new
        return new


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def stream_delta(calls: list[dict[str, Any]], first_index: int) -> dict[str, Any]:
    """A chat chunk delta carrying whole tool calls (indices continue across chunks)."""
    return {"tool_calls": [{"index": first_index + i, **c} for i, c in enumerate(calls)]}


def finish_reason(plan: ToolPlan, calls: list[dict[str, Any]], finish: str | None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model chose to call (auto / required) and stopped."""
    return "tool_calls" if calls and finish == "stop" and plan.mode != "named" else finish


def stream_step(ts: ToolStream, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """One streamed step through the tool parser: (chat delta or None when nothing to send, finish_reason)."""
    content, calls = ts.feed(text)
    if finish is not None:
        more, last = ts.finish()
        content, calls = content + more, calls + last
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta.update(stream_delta(calls, len(ts.calls) - len(calls)))
    return (delta or None), finish_reason(ts.plan, ts.calls, finish)


def choice_with_calls(
    plan: ToolPlan, text: str, finish: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A whole choice: (content, tool calls, finish_reason)."""
    if plan.mode == "none":
        return text, [], finish
    if plan.mode == "auto":
        content, calls = parse_text(text)
    else:
        calls = parse_forced(plan, text)
        content = None if calls else text
    return content, calls, finish_reason(plan, calls, finish)
