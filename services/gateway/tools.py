"""Tool calling for DeepSeek-V3's chat format: what the request asks (`ToolPlan`); the tool calls are
parsed out of the output, whole or streamed, by services.gateway.tool_parser."""

# tool_choice, as vLLM implements it:
# - "auto" (the default with tools): the template renders the tools; the output is scanned for DeepSeek-V3
#   tool calls (`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```
#   <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`); text before them is the message content.
# - "none": no tools rendered, nothing parsed.
# - "required" / a named function: the output is constrained by a JSON schema (structured output) — a
#   non-empty array of {"name", "parameters"} for required, the function's parameters for a named one —
#   and becomes the tool calls.
# Pure code: no I/O, no tokenizer.

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proto.messages import Guided
from services.gateway.errors import bad_param


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
