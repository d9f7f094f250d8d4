"""Function calling, answer side: one choice's generated text, as it streams, read into content
and calls (`ToolPlan` says how).

* ``auto``: the Hermes format (Qwen2.5 and Qwen3, Hermes 2 and 3, and the many models tuned on
  them, what vLLM's ``hermes`` parser reads): each call is a JSON object ``{"name": ...,
  "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text outside the tags
  is content. A block that is not such JSON stays in the content, as written.
* forced (``required``, a named function): the whole text is the grammar's JSON, read when
  the choice ends; should it not parse (cut off by ``max_tokens``), it is the content.

Arguments are sent as compact JSON text (``json.dumps``), whatever spacing the model wrote.

A call is sent whole, once its closing tag has come; content streams as it comes, less any
tail that may be the start of ``<tool_call>``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from shoal.services.gateway.openai_api import FunctionCallOut, ToolCallOut
from shoal.services.gateway.tools import ToolPlan

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class ToolCallReader:
    """One choice's text in, (content, calls) out; `finish` when the choice ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._pending = ""
        """Text not yet given out: a forced answer whole; else a possible tag start, or a call's body."""
        self._in_call = False
        self._num_calls = 0
        self._after_call = False
        """Since the last call, only whitespace: the format's, not content (dropped)."""

    @property
    def made_calls(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallOut]]:
        """The content and the whole calls that `text` completes."""
        self._pending += text
        if self._plan.choice != "auto":
            return "", []
        content: list[str] = []
        calls: list[ToolCallOut] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE_TAG)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE_TAG):]
                self._in_call = False
                calls += self._take_block(body, closed=True, content=content)
            else:
                start = self._pending.find(OPEN_TAG)
                if start < 0:
                    keep = _tag_start_length(self._pending)
                    content.append(self._visible(self._pending[:len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._visible(self._pending[:start]))
                self._pending = self._pending[start + len(OPEN_TAG):]
                self._in_call = True
        return "".join(content), calls

    def finish(self, finish_reason: str) -> tuple[str, list[ToolCallOut], str]:
        """What remains when the choice ended, and its finish reason: ``tool_calls`` when it
        made calls and stopped by itself (not at ``max_tokens``)."""
        pending, self._pending = self._pending, ""
        content: list[str] = []
        calls: list[ToolCallOut] = []
        if self._plan.choice == "auto":
            if self._in_call:  # no closing tag: a call if its JSON is whole
                calls += self._take_block(pending, closed=False, content=content)
            else:
                content.append(self._visible(pending))
        else:
            forced_calls = self._forced_calls(pending)
            if forced_calls is None:
                content.append(pending)
            else:
                calls += self._numbered(forced_calls)
        if self.made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return "".join(content), calls, finish_reason

    def _take_block(self, body: str, *, closed: bool, content: list[str]) -> list[ToolCallOut]:
        call = _hermes_call(body)
        if call is None:
            content.append(self._visible(OPEN_TAG + body + (CLOSE_TAG if closed else "")))
            return []
        return self._numbered([call])

    def _forced_calls(self, text: str) -> list[FunctionCallOut] | None:
        try:
            answer = json.loads(text)
        except ValueError:
            return None
        if self._plan.choice == "named":
            assert self._plan.function is not None, "a named choice names its function"
            if not isinstance(answer, dict):
                return None
            return [FunctionCallOut(self._plan.function, json.dumps(answer, ensure_ascii=False))]
        if not isinstance(answer, list):
            return None
        calls = [_call_of(item) for item in answer]
        return None if not calls or None in calls else [call for call in calls if call is not None]

    def _numbered(self, calls: list[FunctionCallOut]) -> list[ToolCallOut]:
        """`calls` with ids; past the first, none when ``parallel_tool_calls`` is false."""
        if not self._plan.parallel:
            calls = calls[:max(0, 1 - self._num_calls)]
        self._num_calls += len(calls)
        self._after_call = True
        return [ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", call) for call in calls]

    def _visible(self, text: str) -> str:
        """The content given out of `text`; whitespace right after a call is the format's, not content."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def _tag_start_length(text: str) -> int:
    """How long a tail of `text` is a proper start of `OPEN_TAG` (held back: the tag may follow)."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


def _hermes_call(body: str) -> FunctionCallOut | None:
    try:
        return _call_of(json.loads(body))
    except ValueError:
        return None


def _call_of(item: Any) -> FunctionCallOut | None:
    """``{"name": ..., "arguments": {...}}`` (or ``"parameters"``, as some models write) as a call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        return FunctionCallOut(item["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return FunctionCallOut(item["name"], json.dumps(arguments, ensure_ascii=False))
