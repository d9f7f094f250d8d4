"""One choice's text read, as it streams, into reasoning, content and function calls: the
model's thinking split out first (reasoning.py, models with a ``reasoning_parser``), then the
content read for calls (tool_call_parser.py, requests with tools). Without either, the text
is content as it comes."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.services.gateway.openai_api import ToolCallOut
from shoal.services.gateway.reasoning import ReasoningReader
from shoal.services.gateway.tool_call_parser import ToolCallReader


@dataclass
class Read:
    """What a piece of a choice's text gave out."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)

    def __add__(self, later: Read) -> Read:
        return Read(self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls)


class AnswerReader:
    def __init__(self, reasoning: ReasoningReader | None = None, tools: ToolCallReader | None = None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def passes_through(self) -> bool:
        """Text comes out as content as it goes in (nothing is read out of it)."""
        return self._reasoning is None and self._tools is None

    @property
    def num_reasoning_tokens(self) -> int:
        """Tokens of the answer the model thought in (those fed with `num_tokens`)."""
        return self._reasoning.num_reasoning_tokens if self._reasoning is not None else 0

    def feed(self, text: str, num_tokens: int = 0) -> Read:
        reasoning, content = (self._reasoning.feed(text, num_tokens) if self._reasoning is not None
                              else ("", text))
        return Read(reasoning) + self._content(content)

    def finish(self, finish_reason: str) -> tuple[Read, str]:
        """What was held when the choice ended, and its finish reason (``tool_calls`` when it
        made calls and stopped by itself)."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        read = Read(reasoning) + self._content(content)
        if self._tools is None:
            return read, finish_reason
        text, calls, finish_reason = self._tools.finish(finish_reason)
        return read + Read(content=text, calls=calls), finish_reason

    def _content(self, text: str) -> Read:
        if self._tools is None or not text:
            return Read(content=text)
        content, calls = self._tools.feed(text)
        return Read(content=content, calls=calls)
