"""Tool calls parsed out of a choice's text by one incremental parser, streamed or whole."""

# Streamed as vLLM and OpenAI stream them: a call's first delta carries `index`, `id`, `type` and
# `function.name` (with empty `arguments`), later deltas only `index` and `function.arguments` fragments as
# the model writes them. A whole (non-streamed) choice runs the same parser over its text at once, so the
# concatenated fragments are exactly the non-streamed `arguments`.
#
# By tool_choice (services.gateway.tools):
# - auto: DeepSeek-V3's `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\n```json\nARGS
#   \n```<｜tool▁call▁end｜>...` after the message content; text that could begin a marker is held back.
#   Output that begins the calls section but never names a call is content after all.
# - named: the whole output (constrained to the function's parameters) is the one call's arguments.
# - required: the output (constrained to `[{"name": ..., "parameters": {...}}, ...]`) is scanned as JSON;
#   each element's `parameters` text is a call's arguments.
# - none: all content.
# Arguments are the model's text with surrounding whitespace stripped (trailing whitespace is held back
# until more text follows). A call cut short (max_tokens) keeps the arguments written so far.
# Pure code: no I/O, no tokenizer.

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.gateway.tools import ToolPlan

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_SEP = "<｜tool▁sep｜>"
ARGS_BEGIN = "\n```json\n"
CALL_END = "\n```<｜tool▁call▁end｜>"

# What a scanner reports, in order: ("content", text) | ("call", name) | ("args", fragment of the last call)
Event = tuple[str, str]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class _Stripped:
    """One call's arguments streamed with surrounding whitespace removed, as str.strip() would."""

    started: bool = False
    held: str = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        out = text.rstrip()
        self.held = text[len(out) :]
        return out


class _Content:
    """tool_choice none: everything is content."""

    def feed(self, text: str) -> list[Event]:
        return [("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


@dataclass
class _DeepSeekCalls:
    """tool_choice auto: content, then DeepSeek-V3's tool-call markers."""

    state: str = "content"  # content | between | header | args
    buf: str = ""
    raw: str = ""  # everything after the calls-begin marker, in case no call follows
    calls: int = 0
    args: _Stripped = field(default_factory=_Stripped)

    def feed(self, text: str) -> list[Event]:
        if self.state != "content":
            self.raw += text
        self.buf += text
        events: list[Event] = []
        while self._advance(events):
            pass
        return events

    def _advance(self, events: list[Event]) -> bool:
        """Consume what the buffer allows in the current state; True when the state changed."""
        if self.state == "content":
            i = self.buf.find(CALLS_BEGIN)
            if i < 0:
                return self._hold(CALLS_BEGIN, lambda t: events.append(("content", t)))
            events.append(("content", self.buf[:i]))
            self.buf = self.raw = self.buf[i + len(CALLS_BEGIN) :]
            self.state = "between"
        elif self.state == "between":  # text between calls (newlines, the end marker) is dropped
            i = self.buf.find(CALL_BEGIN)
            if i < 0:
                return self._hold(CALL_BEGIN, lambda t: None)
            self.buf, self.state = self.buf[i + len(CALL_BEGIN) :], "header"
        elif self.state == "header":
            j = self.buf.find(CALL_SEP)
            k = self.buf.find(ARGS_BEGIN, j + len(CALL_SEP)) if j >= 0 else -1
            if k < 0:
                return False
            events.append(("call", self.buf[j + len(CALL_SEP) : k].strip()))
            self.calls += 1
            self.buf, self.state, self.args = self.buf[k + len(ARGS_BEGIN) :], "args", _Stripped()
        else:
            i = self.buf.find(CALL_END)
            if i < 0:
                return self._hold(CALL_END, lambda t: events.append(("args", self.args.push(t))))
            events.append(("args", self.args.push(self.buf[:i])))
            self.buf, self.state = self.buf[i + len(CALL_END) :], "between"
        return True

    def _hold(self, marker: str, emit: Callable[[str], object]) -> bool:
        """Pass on the buffer but for a tail that could begin `marker`; the state stays."""
        keep = partial_suffix(self.buf, marker)
        emit(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def finish(self) -> list[Event]:
        if self.state == "content":
            return [("content", self.buf)]
        if not self.calls:
            return [("content", CALLS_BEGIN + self.raw)]
        return [("args", self.args.push(self.buf))] if self.state == "args" else []


@dataclass
class _NamedCall:
    """tool_choice naming a function: the output is its arguments."""

    name: str
    raw: str = ""
    called: bool = False
    args: _Stripped = field(default_factory=_Stripped)

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        out = self.args.push(text)
        if not out:
            return []
        events: list[Event] = [] if self.called else [("call", self.name)]
        self.called = True
        return [*events, ("args", out)]

    def finish(self) -> list[Event]:
        return [] if self.called else [("content", self.raw)]


def _json_string(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw.strip('"')
    return value if isinstance(value, str) else raw


@dataclass
class _RequiredCalls:
    """tool_choice required: a JSON array of {"name", "parameters"} objects, scanned a character at a
    time (depth 1: the array, depth 2: a call object; strings tracked so brackets inside them are text)."""

    raw: str = ""
    depth: int = 0
    in_str: bool = False
    escaped: bool = False
    expect_key: bool = False  # at depth 2: the next string is a key
    key: str = ""  # the last key read at depth 2
    role: str = ""  # the string being read: "key", "name" or "" (neither)
    text: str = ""  # that string so far, quotes included
    capturing: bool = False  # inside the current call's parameters value
    name: str | None = None
    called: bool = False  # the current call's header went out
    pending: str = ""  # arguments read before the call's name
    calls: int = 0
    args: _Stripped = field(default_factory=_Stripped)

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        events: list[Event] = []
        for c in text:
            self._char(c, events)
        return events

    def _char(self, c: str, events: list[Event]) -> None:
        if self.in_str:
            self._string_char(c, events)
        elif c == '"':
            self.in_str = True
            if self.capturing:
                self._arg(c, events)
            else:
                self.text = c
                at_call = self.depth == 2
                self.role = (
                    "key" if at_call and self.expect_key else "name" if at_call and self.key == "name" else ""
                )
        elif self.capturing and not (self.depth == 2 and c in ",}"):
            self.depth += (c in "{[") - (c in "}]")
            self._arg(c, events)
        else:
            self.capturing = False
            self._structure(c, events)

    def _string_char(self, c: str, events: list[Event]) -> None:
        if self.capturing:
            self._arg(c, events)
        else:
            self.text += c
        if self.escaped:
            self.escaped = False
        elif c == "\\":
            self.escaped = True
        elif c == '"':
            self.in_str = False
            if self.capturing:
                return
            if self.role == "key":
                self.key = _json_string(self.text)
            elif self.role == "name":
                self.name = _json_string(self.text)
                self._header(events)

    def _structure(self, c: str, events: list[Event]) -> None:
        if c in "{[":
            self.depth += 1
            if self.depth == 2:  # a new call
                self.expect_key, self.key, self.name, self.called, self.pending = True, "", None, False, ""
        elif c in "}]":
            self.depth -= 1
        elif c == ":" and self.depth == 2:
            self.expect_key = False
            if self.key == "parameters":
                self.capturing, self.args = True, _Stripped()
        elif c == "," and self.depth == 2:
            self.expect_key = True

    def _header(self, events: list[Event]) -> None:
        if self.called or self.name is None:
            return
        self.called = True
        self.calls += 1
        events.append(("call", self.name))
        if self.pending:
            events.append(("args", self.pending))
            self.pending = ""

    def _arg(self, c: str, events: list[Event]) -> None:
        out = self.args.push(c)
        if not out:
            return
        if self.called:
            events.append(("args", out))
        else:
            self.pending += out

    def finish(self) -> list[Event]:
        return [] if self.calls else [("content", self.raw)]


class _Scanner(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def _scanner(plan: ToolPlan) -> _Scanner:
    if plan.mode == "auto":
        return _DeepSeekCalls()
    if plan.mode == "named":
        assert plan.name is not None
        return _NamedCall(plan.name)
    if plan.mode == "required":
        return _RequiredCalls()
    return _Content()


class ToolStream:
    """One choice's text through its tool parser: message content and OpenAI tool-call deltas.
    `calls` holds the calls so far, whole (what a non-streamed response carries)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[dict[str, Any]] = []
        self._scanner = _scanner(plan)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool-call deltas) after `text`."""
        return self._apply(self._scanner.feed(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content left, tool-call deltas left) at the end of the choice."""
        return self._apply(self._scanner.finish())

    def _apply(self, events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: dict[int, dict[str, Any]] = {}  # one delta per call per step, fragments merged
        for kind, value in events:
            if kind == "content":
                content.append(value)
            elif kind == "call":
                call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
                self.calls.append(
                    {"id": call_id, "type": "function", "function": {"name": value, "arguments": ""}}
                )
                i = len(self.calls) - 1
                deltas[i] = {
                    "index": i,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": value, "arguments": ""},
                }
            elif value:
                i = len(self.calls) - 1
                self.calls[i]["function"]["arguments"] += value
                delta = deltas.setdefault(i, {"index": i, "function": {"arguments": ""}})
                delta["function"]["arguments"] += value
        return "".join(content), list(deltas.values())


def finish_reason(plan: ToolPlan, calls: list[dict[str, Any]], finish: str | None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model chose to call (auto / required) and stopped."""
    return "tool_calls" if calls and finish == "stop" and plan.mode != "named" else finish


def stream_step(ts: ToolStream, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """One streamed step through the tool parser: (chat delta or None when nothing to send, finish_reason)."""
    content, calls = ts.feed(text)
    if finish is not None:
        more, last = ts.finish()
        content, calls = content + more, _merge(calls + last)
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return (delta or None), finish_reason(ts.plan, ts.calls, finish)


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of one chunk, one per call (a call's fragments from feed and finish joined)."""
    out: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d["index"] in out:
            out[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out[d["index"]] = d
    return list(out.values())


def choice_with_calls(
    plan: ToolPlan, text: str, finish: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A whole choice: (content, tool calls, finish_reason); content None when only calls were made."""
    ts = ToolStream(plan)
    content = ts.feed(text)[0] + ts.finish()[0]
    return (content or None) if ts.calls else content, ts.calls, finish_reason(plan, ts.calls, finish)


def parse_text(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole DeepSeek-V3 output (tool_choice auto)."""
    content, calls, _ = choice_with_calls(ToolPlan("auto", []), text, None)
    return content, calls
