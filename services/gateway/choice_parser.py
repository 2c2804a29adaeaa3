"""A chat choice's text through the reasoning split (reasoning.py), then its answer through the tool-call parser
(tool_parser.py): the chunks' deltas when streamed, the message's fields when whole."""

# Tool calls and forced output are read from the answer only: reasoning text that happens to hold a tool
# marker stays reasoning. Pure code: no I/O, no tokenizer.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway import tool_parser
from services.gateway.reasoning import ReasoningStream, split_reasoning
from services.gateway.tools import ToolPlan


@dataclass
class ChoiceParser:
    """One streamed choice: `reasoning` when its output starts inside the reasoning, `tools` with tools."""

    reasoning: ReasoningStream | None
    tools: tool_parser.ToolStream | None

    @classmethod
    def create(cls, reasoning: bool, plan: ToolPlan | None) -> ChoiceParser:
        rs = ReasoningStream.for_prompt(True) if reasoning else None
        return cls(rs, tool_parser.ToolStream(plan) if plan is not None else None)

    def step(self, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(chat delta, None when nothing to send; finish_reason) for one streamed step's text."""
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if finish is not None and self.reasoning is not None:
            reasoning += self.reasoning.finish()
        if self.tools is not None:
            delta, finish = tool_parser.stream_step(self.tools, answer, finish)
            delta = delta or {}
        else:
            delta = {"content": answer} if answer else {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        return delta or None, finish


@dataclass(frozen=True)
class Message:
    """A whole choice's message fields: content None when the choice wrote only reasoning or only calls."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


def whole_message(reasoning: bool, plan: ToolPlan | None, text: str, finish: str | None) -> Message:
    thought, answer = split_reasoning(text, True) if reasoning else (None, text)
    content: str | None = answer
    calls: list[dict[str, Any]] = []
    if plan is not None:
        content, calls, finish = tool_parser.choice_with_calls(plan, answer, finish)
    if thought is not None and not content:
        content = None  # as vLLM: no answer after the reasoning (cut short by max_tokens, or calls only)
    return Message(content, thought, calls, finish)
