"""Reasoning output (`reasoning_content`) split from a chat choice's text: DeepSeek-R1's `<think>...</think>`,
streamed or whole, with the parser chosen per model (`reasoning_parser`)."""

# As vLLM's DeepSeekR1ReasoningParser: R1's chat template already ends the prompt with `<think>\n`, so the
# output may hold only `</think>`; everything before it is reasoning, everything after it the answer (no
# `</think>` at all: all reasoning). A leading `<think>` the model writes itself is dropped. Whether a
# choice starts inside the reasoning is read from the rendered prompt: DeepSeek-V3.1's template ends a
# non-thinking turn with `</think>` (chat_template_kwargs thinking false), and then the whole output is
# the answer. Text that could begin a marker is held back until the next text decides.
# Pure code: no I/O, no tokenizer.

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.tool_parser import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("deepseek_r1",)
CHOICES = ("auto", "none", *PARSERS)


def resolve_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser a gateway runs: "auto" takes deepseek_r1 when the chat template writes `<think>` (R1,
    V3.1) and none otherwise (V3); ValueError for an unknown name."""
    if setting not in CHOICES:
        raise ValueError(f"reasoning_parser must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "auto":
        return "deepseek_r1" if chat_template is not None and THINK_START in chat_template else None
    return None if setting == "none" else setting


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether a choice's output begins inside the reasoning: unless the prompt closed it already."""
    return not prompt_text.rstrip().endswith(THINK_END)


@dataclass
class ReasoningStream:
    """One choice's text split into (reasoning, answer) pieces as it streams in."""

    state: str = "start"  # start (a leading <think> may come) | reasoning | answer
    buf: str = ""

    @classmethod
    def for_prompt(cls, in_reasoning: bool) -> ReasoningStream:
        return cls("start" if in_reasoning else "answer")

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text that `text` released."""
        if self.state == "answer":
            return "", text
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip()
            if THINK_START.startswith(head):  # all of it could still be the opening marker
                return "", ""
            self.state = "reasoning"
            if head.startswith(THINK_START):
                self.buf = head[len(THINK_START) :]
        i = self.buf.find(THINK_END)
        if i >= 0:
            reasoning, answer = self.buf[:i], self.buf[i + len(THINK_END) :]
            self.buf, self.state = "", "answer"
            return reasoning, answer
        keep = partial_suffix(self.buf, THINK_END)
        reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return reasoning, ""

    def finish(self) -> str:
        """The reasoning held back at the end of the choice (a marker's beginning that never completed)."""
        held, self.buf = self.buf, ""
        return held


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole choice: (reasoning, None when the prompt had closed it; answer)."""
    rs = ReasoningStream.for_prompt(in_reasoning)
    reasoning, answer = rs.feed(text)
    return (reasoning + rs.finish() if in_reasoning else None), answer
